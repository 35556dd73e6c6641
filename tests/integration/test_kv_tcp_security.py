"""The tcp KV transport's connection checks, against a real producer process: mutual TLS with
the cluster's certificates, and without them a proof of the cluster secret before any read."""

import contextlib
import socket
import struct
import threading

import pytest
import torch
from test_kv_transport import LAYOUT, Producer, consumer
from test_mtls import make_pki

from pdserve.kv_transfer import KVTransferError
from pdserve.kv_transfer.socket_tls import SocketTls
from pdserve.kv_transfer.tcp_transport import LEASE, MAGIC, OP_HELLO, OP_READ, REPLY, REQ
from pdserve.kv_transfer.transport import DESCRIPTOR_VERSION, KVLayout

SECRET = "s" * 40

LAYOUT_F32 = {**LAYOUT, "dtype": "float32"}


def tls_of(pki: dict[str, str], trust: dict[str, str] | None = None) -> SocketTls:
    """Contexts presenting `pki`'s certificate and trusting `trust`'s CA (default: its own)."""
    pem = {k: open(v, "rb").read() for k, v in pki.items()}
    return SocketTls.from_pem(pem["cert"], pem["key"], open((trust or pki)["ca"], "rb").read())


def test_tcp_transport_over_mutual_tls(tmp_path):
    pki, outsider = make_pki(tmp_path, "cluster"), make_pki(tmp_path, "outsider")
    producer = Producer("tcp", LAYOUT_F32, seed=3, tls=pki)
    try:
        desc, want = producer.descriptor, producer.expected()
        with consumer("tcp", LAYOUT_F32, timeout_s=3.0, tls=tls_of(pki)) as dec:
            assert dec.read_blocks(desc, [3, 4, 9], [0, 1, 5], producer.lease) > 0
            assert torch.equal(dec.kv_cache[:, :, [0, 1, 5]], want[:, :, [3, 4, 9]])
        # plaintext; another CA (the reader refuses the producer); a reader whose certificate
        # another CA signed but who trusts the cluster's (the producer refuses it)
        for tls in (None, tls_of(outsider), tls_of(outsider, trust=pki)):
            with consumer("tcp", LAYOUT_F32, timeout_s=3.0, tls=tls) as stranger:
                with pytest.raises(KVTransferError):
                    stranger.read_blocks(desc, [3], [0], producer.lease)
                assert not stranger.kv_cache.any()  # not one byte, even with the lease token
        assert producer.proc.poll() is None  # refused handshakes do not hurt the producer
        with consumer("tcp", LAYOUT_F32, timeout_s=3.0, tls=tls_of(pki)) as dec:
            assert dec.read_blocks(desc, [2], [2], producer.small_lease) > 0
            assert torch.equal(dec.kv_cache[:, :, 2], want[:, :, 2])
    finally:
        producer.stop()


def test_tcp_producer_with_a_secret_serves_only_readers_that_prove_it():
    producer = Producer("tcp", LAYOUT_F32, seed=5, cluster_secret=SECRET)
    try:
        desc, want = producer.descriptor, producer.expected()
        for secret, match in ((None, "needs the cluster secret"), ("t" * 40, "proof refused")):
            with consumer("tcp", LAYOUT_F32, timeout_s=3.0, cluster_secret=secret) as stranger:
                with pytest.raises(KVTransferError, match=match):
                    stranger.read_blocks(desc, [3], [0], producer.lease)
                assert not stranger.kv_cache.any()
        # A raw client that skips the proof gets an error, not blocks, even with the token.
        lease_id, token = (part.encode() for part in producer.lease)
        with socket.create_connection((desc["host"], desc["port"]), timeout=5) as raw:
            hello = desc["engine_id"].encode()
            raw.sendall(REQ.pack(MAGIC, OP_HELLO, len(hello)) + hello)
            status, length = REPLY.unpack(raw.recv(REPLY.size, socket.MSG_WAITALL))
            assert status == 0 and length == 32  # a challenge
            raw.recv(length, socket.MSG_WAITALL)
            body = LEASE.pack(len(lease_id), len(token)) + lease_id + token + struct.pack("!I", 3)
            raw.sendall(REQ.pack(MAGIC, OP_READ, len(body)) + body)
            status, length = REPLY.unpack(raw.recv(REPLY.size, socket.MSG_WAITALL))
            assert status == 1 and b"cluster secret" in raw.recv(length, socket.MSG_WAITALL)
        with consumer("tcp", LAYOUT_F32, timeout_s=3.0, cluster_secret=SECRET) as dec:
            assert dec.read_blocks(desc, [3, 4], [0, 1], producer.lease) > 0
            assert torch.equal(dec.kv_cache[:, :, [0, 1]], want[:, :, [3, 4]])
        assert producer.proc.poll() is None
    finally:
        producer.stop()


def test_a_producer_claiming_a_huge_refusal_is_cut_off_before_any_allocation():
    """The length of a refusal comes from the producer, whose address a Decode caller names:
    a reader allocates nothing of the size it claims (a terabyte here) and fails at once."""
    listener = socket.create_server(("127.0.0.1", 0))
    claims = []

    def lying_producer():
        conn, _ = listener.accept()
        with conn:
            _, _, length = REQ.unpack(conn.recv(REQ.size, socket.MSG_WAITALL))
            conn.recv(length, socket.MSG_WAITALL)
            conn.sendall(REPLY.pack(0, 0))  # hello accepted, no challenge
            _, _, length = REQ.unpack(conn.recv(REQ.size, socket.MSG_WAITALL))
            conn.recv(length, socket.MSG_WAITALL)
            claims.append(1 << 40)
            conn.sendall(REPLY.pack(1, 1 << 40))
            conn.recv(1)  # until the reader hangs up

    thread = threading.Thread(target=lying_producer, daemon=True)
    thread.start()
    remote = {"kind": "tcp", "version": DESCRIPTOR_VERSION, "engine_id": "liar",
              "host": "127.0.0.1", "port": listener.getsockname()[1],
              "layout": KVLayout(**{**LAYOUT_F32, "num_blocks": 32}).to_dict()}
    try:
        with consumer("tcp", LAYOUT_F32, timeout_s=3.0) as dec:
            with pytest.raises(KVTransferError, match="refusal"):
                dec.read_blocks(remote, [3], [0], ("lease", "token"))
        thread.join(timeout=5)
        assert claims and not thread.is_alive()
    finally:
        listener.close()


def test_before_the_proof_only_handshake_sized_frames_are_read():
    """A stranger's frame header claiming 16 MiB is refused at once: nothing of that size is
    allocated, and the producer serves a reader with the secret right after."""
    producer = Producer("tcp", LAYOUT_F32, seed=7, cluster_secret=SECRET)
    try:
        desc = producer.descriptor
        with socket.create_connection((desc["host"], desc["port"]), timeout=5) as raw:
            raw.sendall(REQ.pack(MAGIC, OP_HELLO, 1 << 24))
            status, length = REPLY.unpack(raw.recv(REPLY.size, socket.MSG_WAITALL))
            assert status == 1 and b"bad request frame" in raw.recv(length, socket.MSG_WAITALL)
        with consumer("tcp", LAYOUT_F32, timeout_s=3.0, cluster_secret=SECRET) as dec:
            assert dec.read_blocks(desc, [3], [0], producer.lease) > 0
    finally:
        producer.stop()


def test_a_read_naming_a_block_twice_is_refused():
    """A one-block lease cannot be read many times over in one request (a reply larger than
    the lease, and a copy of it on the producer)."""
    producer = Producer("tcp", LAYOUT_F32, seed=8)
    try:
        with consumer("tcp", LAYOUT_F32, timeout_s=3.0) as dec:
            with pytest.raises(KVTransferError, match="repeat"):
                dec.read_blocks(producer.descriptor, [2, 2], [0, 1], producer.small_lease)
            assert not dec.kv_cache.any()
            assert dec.read_blocks(producer.descriptor, [2], [0], producer.small_lease) > 0
    finally:
        producer.stop()


def test_a_producer_that_trickles_its_reply_fails_the_read_in_time():
    """One byte every 0.2 s keeps each recv under a 1 s timeout; the whole read has one
    deadline (timeout plus the bytes at 10 MB/s), so it fails instead of holding the
    engine's read slot for the length of the reply."""
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    layout = KVLayout(**{**LAYOUT_F32, "num_blocks": 32})

    def trickling_producer():
        conn, _ = listener.accept()
        with conn:
            _, _, length = REQ.unpack(conn.recv(REQ.size, socket.MSG_WAITALL))
            conn.recv(length, socket.MSG_WAITALL)
            conn.sendall(REPLY.pack(0, 0))
            _, _, length = REQ.unpack(conn.recv(REQ.size, socket.MSG_WAITALL))
            conn.recv(length, socket.MSG_WAITALL)
            conn.sendall(REPLY.pack(0, layout.block_bytes))
            with contextlib.suppress(OSError):
                for _ in range(200):
                    conn.sendall(b"\0")
                    time.sleep(0.2)

    thread = threading.Thread(target=trickling_producer, daemon=True)
    thread.start()
    remote = {"kind": "tcp", "version": DESCRIPTOR_VERSION, "engine_id": "slow",
              "host": "127.0.0.1", "port": listener.getsockname()[1],
              "layout": layout.to_dict()}
    try:
        with consumer("tcp", LAYOUT_F32, timeout_s=1.0) as dec:
            start = time.monotonic()
            with pytest.raises(KVTransferError, match="failed"):
                dec.read_blocks(remote, [3], [0], ("lease", "token"))
            assert time.monotonic() - start < 10
    finally:
        listener.close()


def test_a_read_larger_than_one_send_chunk_arrives_exact():
    """A tcp producer copies and sends a reply a chunk of blocks at a time, plane by plane,
    checking the lease before each: 150 scattered blocks (three chunks a plane) arrive exact."""
    import random

    from pdserve.kv_transfer import make_transport
    from pdserve.kv_transfer.tcp_transport import SEND_CHUNK_BLOCKS

    layout = KVLayout(**{**LAYOUT_F32, "num_blocks": 200})
    producer = make_transport("tcp", "prefill-chunks")
    producer.allocate_kv_cache(layout)
    producer.kv_cache.copy_(torch.randn(producer.kv_cache.shape))
    remote = random.Random(3).sample(range(200), 150)
    local = random.Random(4).sample(range(200), 150)
    assert len(remote) > 2 * SEND_CHUNK_BLOCKS
    try:
        desc = producer.serve()
        token = producer.grant("chunks", remote)
        with consumer("tcp", LAYOUT_F32, num_blocks=200, timeout_s=3.0) as dec:
            assert dec.read_blocks(desc, remote, local, ("chunks", token)) == \
                len(remote) * layout.block_bytes
            assert torch.equal(dec.kv_cache[:, :, local], producer.kv_cache[:, :, remote])
    finally:
        producer.close()


def test_a_reader_keeps_a_bounded_number_of_producer_connections(monkeypatch):
    """Descriptors may name any producer: past MAX_PEERS the least recently used connection
    closes, and a later read from it connects again."""
    from pdserve.kv_transfer import tcp_transport

    monkeypatch.setattr(tcp_transport, "MAX_PEERS", 1)
    first, second = Producer("tcp", LAYOUT_F32, seed=11), Producer("tcp", LAYOUT_F32, seed=12)
    try:
        with consumer("tcp", LAYOUT_F32, timeout_s=3.0) as dec:
            assert dec.read_blocks(first.descriptor, [1], [0], first.lease) > 0
            [old] = dec._peers.values()
            assert dec.read_blocks(second.descriptor, [2], [1], second.lease) > 0
            assert old.fileno() == -1  # closed
            assert [key[2] for key in dec._peers] == [second.descriptor["engine_id"]]
            assert dec.read_blocks(first.descriptor, [3], [2], first.lease) > 0
            assert torch.equal(dec.kv_cache[:, :, [0, 2]], first.expected()[:, :, [1, 3]])
            assert torch.equal(dec.kv_cache[:, :, 1], second.expected()[:, :, 2])
    finally:
        first.stop()
        second.stop()


def test_a_lease_revoked_mid_reply_cuts_a_slow_reader_off():
    """A slow reader is still being sent to when the lease ends and the blocks take other
    content: it gets only bytes copied while the lease held, then the connection ends."""
    from pdserve.kv_transfer import make_transport

    layout = KVLayout(num_layers=2, num_blocks=1024, block_size=16, num_kv_heads=4,
                      head_dim=64, dtype="float32")
    producer = make_transport("tcp", "prefill-revoke")
    producer.allocate_kv_cache(layout)
    producer.kv_cache.copy_(torch.randn(producer.kv_cache.shape))
    ids = list(range(1024))
    # What the reply holds: each plane's blocks in order, (layers * 2, blocks, ...) as bytes.
    want = producer.kv_cache.view(4, 1024, -1).clone().numpy().tobytes()
    try:
        desc = producer.serve()
        token = producer.grant("big", ids).encode()
        with socket.create_connection((desc["host"], desc["port"]), timeout=10) as raw:
            hello = desc["engine_id"].encode()
            raw.sendall(REQ.pack(MAGIC, OP_HELLO, len(hello)) + hello)
            status, length = REPLY.unpack(raw.recv(REPLY.size, socket.MSG_WAITALL))
            assert status == 0 and length == 0  # no cluster secret: no challenge
            body = (LEASE.pack(3, len(token)) + b"big" + token
                    + struct.pack(f"!{len(ids)}I", *ids))
            raw.sendall(REQ.pack(MAGIC, OP_READ, len(body)) + body)
            status, length = REPLY.unpack(raw.recv(REPLY.size, socket.MSG_WAITALL))
            assert status == 0 and length == len(want) == 64 << 20
            got = bytearray(raw.recv(1 << 20, socket.MSG_WAITALL))  # a slow reader
            producer.revoke("big")
            producer.kv_cache.zero_()  # the blocks hold another prompt's KV now
            while chunk := raw.recv(1 << 20):
                got += chunk
        assert 1 << 20 <= len(got) < len(want) // 2  # cut off, far from the whole reply
        assert bytes(got) == want[:len(got)]  # nothing but what the lease covered
    finally:
        producer.close()
