"""Contract tests for every KV transport, with the producer in a separate real process."""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.kv_transfer import (
    KVLayout,
    KVTransferError,
    make_transport,
    nixl_available,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kv_producer import DESCRIPTOR_PREFIX, GRANTS_PREFIX, fill_cache

NO_NIXL = pytest.mark.skipif(not nixl_available(), reason="nixl not importable (pip install nixl==1.5.1)")


def cases(*rows: tuple) -> list:
    """pytest params; rows whose kind is nixl are skipped when nixl is missing."""
    return [pytest.param(*row, marks=[NO_NIXL] if row[0] == "nixl" else []) for row in rows]


KINDS = cases(("shm",), ("tcp",), ("nixl",))
LAYOUT = {"num_layers": 3, "num_blocks": 24, "block_size": 4, "num_kv_heads": 2, "head_dim": 8}
REMOTE_IDS = [3, 4, 5, 9, 0, 17, 18, 23, 12]   # runs, singles, out of order
LOCAL_IDS = [10, 11, 12, 2, 30, 5, 6, 20, 13]  # different ids; 12->13 continues a run remotely only
WAIT_S = 20.0


class Producer:
    """A producer process: start, read its descriptor, command it, kill it."""

    def __init__(self, kind: str, layout: dict, seed: int, **options) -> None:
        self.layout, self.seed = layout, seed
        self._pending = b""  # stdout bytes read but not yet consumed as lines
        env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "kv_producer.py"), kind, f"prefill-{seed}",
             json.dumps(layout), str(seed), json.dumps(options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.descriptor = json.loads(self.expect(DESCRIPTOR_PREFIX)[len(DESCRIPTOR_PREFIX):])
        grants = json.loads(self.expect(GRANTS_PREFIX)[len(GRANTS_PREFIX):])
        self.lease = ("all", grants["all"])  # (lease id, token) over every block
        self.small_lease = ("small", grants["small"])  # over blocks 1 and 2

    def expect(self, prefix: str, timeout: float = WAIT_S) -> str:
        """The next stdout line starting with `prefix` (other lines, e.g. library logs, skipped)."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.startswith(prefix.encode()):
                    return line.decode()
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"producer sent no {prefix!r} line within {timeout}s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"producer exited (rc={self.proc.poll()}) before {prefix!r}")
            self._pending += chunk

    def send(self, command: str) -> None:
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()

    def expected(self) -> torch.Tensor:
        return fill_cache(self.layout, self.seed)

    def stop(self) -> int:
        """Close stdin (the producer closes and exits) and reap it; kill it if it hangs."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            rc = self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(timeout=WAIT_S)
        self.proc.stdout.close()
        return rc

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=WAIT_S)


def consumer(kind: str, layout: dict, num_blocks: int = 32, **options):
    transport = make_transport(kind, "decode-0", **options)
    transport.allocate_kv_cache(KVLayout(**{**layout, "num_blocks": num_blocks}))
    return transport


@pytest.mark.parametrize("kind, dtype, ending", cases(
    ("shm", "float32", "close"), ("shm", "bfloat16", "kill"),
    ("tcp", "float32", "kill"), ("tcp", "float16", "close"),
    ("nixl", "float32", "close"), ("nixl", "float16", "kill")))
def test_transport_contract(kind: str, dtype: str, ending: str) -> None:
    """Exact bytes for chosen blocks, clean errors, then the producer closes or is killed."""
    layout = {**LAYOUT, "dtype": dtype}
    producer = Producer(kind, layout, seed=7)
    try:
        with consumer(kind, layout, timeout_s=3.0) as dec:
            desc = producer.descriptor
            assert desc["kind"] == kind and desc["layout"] == layout
            moved = dec.read_blocks(desc, REMOTE_IDS, LOCAL_IDS, producer.lease)
            block_bytes = KVLayout(**layout).block_bytes
            assert moved == len(REMOTE_IDS) * block_bytes
            want = producer.expected()  # (layers, 2, 24, ...)
            got = dec.kv_cache  # (layers, 2, 32, ...)
            assert torch.equal(got[:, :, LOCAL_IDS], want[:, :, REMOTE_IDS])
            untouched = [b for b in range(32) if b not in LOCAL_IDS]
            assert not got[:, :, untouched].any()

            # Out of range is a clean error; the producer keeps serving afterwards.
            with pytest.raises(KVTransferError, match="out of range"):
                dec.read_blocks(desc, [2, LAYOUT["num_blocks"]], [0, 1], producer.lease)
            assert not got[:, :, [0, 1]].any()
            assert dec.read_blocks(desc, [1, 2], [0, 1], producer.small_lease) == 2 * block_bytes
            assert torch.equal(got[:, :, [0, 1]], want[:, :, [1, 2]])
            if kind == "tcp":
                check_tcp_server_rejects_bad_requests(producer)
            if kind == "nixl":
                check_nixl_descriptor_exposes_no_memory(producer)
            if kind in ("tcp", "nixl"):
                check_serves_only_live_leases(producer, dec)
            if kind == "shm":
                check_reads_only_live_leases(producer, dec)
            assert producer.proc.poll() is None

            if ending == "close":
                check_read_after_close(producer, dec)
            else:
                check_dead_producer_fails_fast(producer, dec)
        if ending == "close":
            assert producer.stop() == 0
    finally:
        producer.stop()


def check_read_after_close(producer: Producer, dec) -> None:
    desc = producer.descriptor
    producer.send("close")
    producer.expect("CLOSED")
    if desc["kind"] == "shm":
        assert not os.path.exists(desc["segment"])
        with pytest.raises(KVTransferError, match="gone"):
            dec.read_blocks(desc, [1], [0], producer.lease)
    elif desc["kind"] == "tcp":
        with pytest.raises(KVTransferError):
            dec.read_blocks(desc, [1], [0], producer.lease)


def check_dead_producer_fails_fast(producer: Producer, dec) -> None:
    """SIGKILL the producer (its connection/mapping is cached): a read fails within seconds."""
    desc = producer.descriptor
    producer.kill()
    start = time.monotonic()
    with pytest.raises(KVTransferError):
        dec.read_blocks(desc, [1, 2], [3, 4], producer.lease)
    assert time.monotonic() - start < 5.0
    if desc["kind"] == "shm":  # the consumer removed the segment its dead owner left behind
        assert not os.path.exists(desc["segment"])


def test_shm_segment_removed_at_exit_without_close() -> None:
    producer = Producer("shm", {**LAYOUT, "dtype": "float32"}, seed=5)
    path = producer.descriptor["segment"]
    assert os.path.exists(path)
    producer.send("exit")
    assert producer.stop() == 0
    assert not os.path.exists(path)


def check_tcp_server_rejects_bad_requests(producer: Producer) -> None:
    """Raw requests the client never sends: the server answers errors and keeps serving."""
    from pdserve.kv_transfer.socket_io import recv_exact
    from pdserve.kv_transfer.tcp_transport import LEASE, MAGIC, OP_HELLO, OP_READ, REPLY, REQ

    desc = producer.descriptor
    with socket.create_connection((desc["host"], desc["port"]), timeout=WAIT_S) as s:
        def ask(op: int, payload: bytes) -> tuple[int, bytes]:
            s.sendall(REQ.pack(MAGIC, op, len(payload)) + payload)
            status, length = REPLY.unpack(recv_exact(s, REPLY.size))
            return status, recv_exact(s, length)

        def read(ids: list[int], lease: tuple[str, str]) -> tuple[int, bytes]:
            lease_id, token = (part.encode() for part in lease)
            return ask(OP_READ, LEASE.pack(len(lease_id), len(token)) + lease_id + token
                       + struct.pack(f"!{len(ids)}I", *ids))

        assert ask(OP_HELLO, b"someone-else")[0] == 1
        status, body = read([1, 10_000], producer.lease)
        assert status == 1 and b"not in lease" in body
        status, body = ask(OP_READ, struct.pack("!1I", 1))  # the old, lease-less request
        assert status == 1
        status, body = read([1], producer.lease)
        assert status == 0 and len(body) == KVLayout.from_dict(desc["layout"]).block_bytes
        s.sendall(b"JUNK" + bytes(5))
        status, length = REPLY.unpack(recv_exact(s, REPLY.size))
        assert status == 1 and b"bad request" in recv_exact(s, length)


def check_serves_only_live_leases(producer: Producer, dec) -> None:
    """Prompt theft: whoever can reach the producer gets no block without the lease's token,
    none outside the lease, and none once the lease is revoked (tcp: per read; nixl: no
    registration is made or kept for them)."""
    desc = producer.descriptor
    for lease, ids in [(("", ""), [1]), (("all", "guess"), [1]), (("small", producer.lease[1]), [1]),
                       (producer.small_lease, [1, 3])]:
        with pytest.raises(KVTransferError, match="lease"):
            dec.read_blocks(desc, ids, [7] if len(ids) == 1 else [7, 8], lease)
        assert not dec.kv_cache[:, :, [7, 8]].any()
    producer.send("revoke small")
    producer.expect("REVOKED")
    with pytest.raises(KVTransferError, match="no live lease"):
        dec.read_blocks(desc, [1, 2], [7, 8], producer.small_lease)
    assert dec.read_blocks(desc, [1, 2], [7, 8], producer.lease) > 0  # the other lease lives
    dec.kv_cache[:, :, [7, 8]] = 0


def check_reads_only_live_leases(producer: Producer, dec) -> None:
    """shm: a reader maps the producer's memory, so the lease is checked on the board in the
    segment: a made-up or ended one reads nothing (its blocks may hold another prompt's KV)."""
    desc = producer.descriptor
    slot = producer.small_lease[1].split(".")[0]
    for token in ("", "guess", f"{slot}.12345", "99999999.1"):
        with pytest.raises(KVTransferError, match="lease"):
            dec.read_blocks(desc, [1], [7], ("small", token))
    producer.send("revoke small")
    producer.expect("REVOKED")
    with pytest.raises(KVTransferError, match="has ended"):
        dec.read_blocks(desc, [1, 2], [7, 8], producer.small_lease)
    assert not dec.kv_cache[:, :, [7, 8]].any()
    assert dec.read_blocks(desc, [1, 2], [7, 8], producer.lease) > 0  # the other lease lives
    dec.kv_cache[:, :, [7, 8]] = 0


def check_nixl_descriptor_exposes_no_memory(producer: Producer) -> None:
    """A rogue NIXL agent that loads the producer's published metadata finds no registered
    memory to READ: the producer registers blocks only for a reader with a lease's token."""
    from nixl import _api

    desc = producer.descriptor
    rogue = _api.nixl_agent("rogue", _api.nixl_agent_config(enable_prog_thread=False,
                                                            backends=["UCX"]))
    sink = torch.zeros(KVLayout(**desc["layout"]).block_bytes, dtype=torch.uint8)
    rogue.register_memory(sink)
    peer = rogue.add_remote_agent(base64.b64decode(desc["agent_metadata"]))
    peer = peer.decode() if isinstance(peer, bytes) else peer
    chunk = KVLayout(**desc["layout"]).chunk_bytes
    local = rogue.get_xfer_descs(np.array([[sink.data_ptr(), chunk, 0]], dtype=np.uint64), "DRAM")
    far = rogue.get_xfer_descs(np.array([[desc["base_addr"] + chunk, chunk, 0]],
                                        dtype=np.uint64), "DRAM")
    with pytest.raises(Exception, match="NOT_FOUND"):
        rogue.initialize_xfer("READ", local, far, peer)
    assert not sink.any()
    rogue.remove_remote_agent(peer)


def test_contract_errors_without_processes() -> None:
    with pytest.raises(ValueError, match="connector"):
        make_transport("carrier-pigeon", "e0")
    layout = KVLayout(**LAYOUT, dtype="float32")
    with make_transport("tcp", "e0") as a, make_transport("tcp", "e1") as b:
        a.allocate_kv_cache(layout)
        b.allocate_kv_cache(KVLayout(**{**LAYOUT, "head_dim": 16}, dtype="float32"))
        desc = b.serve()
        with pytest.raises(KVTransferError, match="layouts differ"):
            a.read_blocks(desc, [0], [0])
        with pytest.raises(KVTransferError, match="kind"):
            a.read_blocks({**desc, "kind": "shm"}, [0], [0])
        with pytest.raises(KVTransferError, match="duplicates"):
            a.read_blocks({**desc, "layout": layout.to_dict()}, [0, 1], [2, 2])
        assert a.read_blocks({**desc, "layout": layout.to_dict()}, [], []) == 0


def test_nixl_missing_gives_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl", None)  # as if the package were not installed
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(KVTransferError, match="pip install nixl"):
        make_transport("nixl", "e0")


def _mapped(path: str) -> bool:
    """Whether this process maps `path` (a deleted file shows with the suffix ' (deleted)')."""
    with open("/proc/self/maps") as f:
        return any(path in line for line in f)


def test_shm_consumer_unmaps_a_dead_producers_segment() -> None:
    """A SIGKILLed prefill's segment, swept by its restarted successor, is no longer held by
    the decode side: the next read (from the new producer) drops the stale mapping."""
    layout = {**LAYOUT, "dtype": "float32"}
    first = Producer("shm", layout, seed=11)
    try:
        with consumer("shm", layout) as dec:
            old = first.descriptor["segment"]
            dec.read_blocks(first.descriptor, [1], [0], first.lease)
            assert _mapped(old)
            first.kill()
            second = Producer("shm", layout, seed=12)  # its start sweeps the dead one's segment
            try:
                assert not os.path.exists(old)
                dec.read_blocks(second.descriptor, [2], [1], second.lease)
                gc.collect()
                assert not _mapped(old), "the dead producer's segment is still mapped"
                assert torch.equal(dec.kv_cache[:, :, 1], second.expected()[:, :, 2])
            finally:
                second.stop()
    finally:
        first.stop()


def test_a_descriptor_of_another_version_is_refused_by_name():
    """Mixed versions during an upgrade fail saying so, not with a misleading lease error."""
    layout = {**LAYOUT, "dtype": "float32"}
    with consumer("tcp", layout, timeout_s=1.0) as dec:
        remote = {"kind": "tcp", "version": 1, "engine_id": "old", "layout": layout,
                  "host": "127.0.0.1", "port": 1}
        with pytest.raises(KVTransferError, match="descriptor version 1"):
            dec.read_blocks(remote, [0], [0], ("lease", "token"))
