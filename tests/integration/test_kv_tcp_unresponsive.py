"""A tcp producer that accepts and never answers, or answers a byte at a time, costs a reader
one timeout: the handshake has one deadline, and after a timeout on a fresh connection reads
naming that producer fail at once for a while, so reads from other producers are not held
behind it."""

import contextlib
import os
import signal
import socket
import struct
import threading
import time

import pytest
import torch
from frozen import freeze
from test_kv_transport import LAYOUT, Producer, consumer

from pdserve.kv_transfer import KVTransferError
from pdserve.kv_transfer.tcp_wire import REPLY, REQ
from pdserve.kv_transfer.transport import DESCRIPTOR_VERSION, KVLayout
from pdserve.kv_transfer.unresponsive_peers import UnresponsivePeers

LAYOUT_F32 = {**LAYOUT, "dtype": "float32"}


class SilentProducer:
    """A listener on loopback that accepts connections, keeps them, and sends nothing, or
    (trickle=True) one 0xff byte every 0.2 s: a reply header claiming a huge body."""

    def __init__(self, trickle: bool = False) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.accepted: list[socket.socket] = []
        self.trickle = trickle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        layout = KVLayout(**{**LAYOUT_F32, "num_blocks": 32})
        self.descriptor = {"kind": "tcp", "version": DESCRIPTOR_VERSION, "engine_id": "silent",
                           "host": "127.0.0.1", "port": self.listener.getsockname()[1],
                           "layout": layout.to_dict()}

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                self.accepted.append(self.listener.accept()[0])
            if self.trickle:
                for conn in self.accepted:
                    with contextlib.suppress(OSError):
                        conn.sendall(b"\xff")

    def connections(self, at_least: int) -> int:
        """How many connections it accepted, once at least `at_least` (or 5 s) have come."""
        for _ in range(50):
            if len(self.accepted) >= at_least:
                break
            time.sleep(0.1)
        return len(self.accepted)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self.accepted:
            conn.close()
        self.listener.close()


def read_in_thread(dec, descriptor, lease) -> BaseException | int:
    """read_blocks on a thread that must end within 20 s (the test fails, not hangs)."""
    out: list[BaseException | int] = []

    def run():
        try:
            out.append(dec.read_blocks(descriptor, [3], [0], lease))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the read did not end"
    return out[0]


def test_a_producer_that_trickles_its_handshake_fails_the_read_in_time():
    """Each byte comes well within the 1 s timeout; the claimed body never ends. The whole
    handshake has one deadline, so the read fails instead of waiting for ever, and the
    reader's socket is closed."""
    with contextlib.ExitStack() as stack:
        silent = SilentProducer(trickle=True)
        stack.callback(silent.stop)
        dec = stack.enter_context(consumer("tcp", LAYOUT_F32, timeout_s=1.0))
        error = read_in_thread(dec, silent.descriptor, ("lease", "token"))
        assert isinstance(error, KVTransferError) and "TimeoutError" in str(error)
        assert silent.connections(1) == 1
        conn = silent.accepted[0]
        conn.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            while conn.recv(1 << 16):  # what the reader sent, then its end
                pass


def test_after_a_timeout_reads_naming_that_producer_fail_at_once(monkeypatch):
    from pdserve.kv_transfer import tcp_transport

    monkeypatch.setattr(tcp_transport, "UNRESPONSIVE_HOLD_S", 4.0)
    with contextlib.ExitStack() as stack:
        silent = SilentProducer()
        stack.callback(silent.stop)
        producer = Producer("tcp", LAYOUT_F32, seed=13)
        stack.callback(producer.stop)
        dec = stack.enter_context(consumer("tcp", LAYOUT_F32, timeout_s=1.5))
        error = read_in_thread(dec, silent.descriptor, ("lease", "token"))
        assert isinstance(error, KVTransferError) and "TimeoutError" in str(error)
        assert silent.connections(1) == 1
        for _ in range(3):  # held: no new connection, a clear error
            with pytest.raises(KVTransferError, match="'silent' .* fail at once"):
                dec.read_blocks(silent.descriptor, [3], [0], ("lease", "token"))
        # Other producers are read as before.
        assert dec.read_blocks(producer.descriptor, [4], [1], producer.lease) > 0
        assert torch.equal(dec.kv_cache[:, :, 1], producer.expected()[:, :, 4])
        time.sleep(0.3)  # a connection would have been accepted by now
        assert len(silent.accepted) == 1
        time.sleep(3.8)  # the hold (4 s from the timeout) ends: the next read tries again
        error = read_in_thread(dec, silent.descriptor, ("lease", "token"))
        assert "TimeoutError" in str(error) and silent.connections(2) == 2


def test_a_frozen_producer_is_held_after_a_fresh_connection_times_out():
    """A producer process stopped (SIGSTOP) after a first read: the read on the cached
    connection times out without a hold (a connection dropped on the way looks the same),
    the next one opens a connection, times out in the handshake and holds the producer."""
    producer = Producer("tcp", LAYOUT_F32, seed=14)
    try:
        with consumer("tcp", LAYOUT_F32, timeout_s=1.5) as dec:
            assert dec.read_blocks(producer.descriptor, [4], [1], producer.lease) > 0
            freeze(producer.proc.pid)
            try:
                for where in ("tcp read from", "cannot reach producer"):
                    error = read_in_thread(dec, producer.descriptor, producer.lease)
                    assert where in str(error) and "TimeoutError" in str(error)
                with pytest.raises(KVTransferError, match="fail at once"):
                    dec.read_blocks(producer.descriptor, [4], [1], producer.lease)
            finally:
                os.kill(producer.proc.pid, signal.SIGCONT)
    finally:
        producer.stop()


def test_a_hold_ends_and_the_oldest_is_forgotten_past_capacity():
    peers = UnresponsivePeers(hold_s=3600, capacity=2)
    for key in ("a", "b", "c"):
        peers.mark(key)
    peers.check("a", "producer a")  # forgotten: the oldest of three, past a capacity of two
    for key in ("b", "c"):
        with pytest.raises(KVTransferError, match=f"^producer {key} timed out"):
            peers.check(key, f"producer {key}")
    ended = UnresponsivePeers(hold_s=0)
    ended.mark("a")
    ended.check("a", "producer a")  # a hold of no time is over at once
    doubted = UnresponsivePeers(hold_s=3600)
    doubted.mark("a", sure=False)
    doubted.check("a", "producer a")  # one timeout that may not be theirs: no hold
    doubted.mark("a", sure=False)
    with pytest.raises(KVTransferError, match="^producer a timed out"):
        doubted.check("a", "producer a")


class ScriptedProducer:
    """A producer on loopback that answers HELLO, then each READ on a connection with the
    next of `replies` (bytes to send, or None: say nothing), one thread a connection."""

    def __init__(self, hello: bytes, replies: list[bytes | None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.hello, self.replies, self.connections = hello, replies, 0
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()
        layout = KVLayout(**{**LAYOUT_F32, "num_blocks": 32})
        self.descriptor = {"kind": "tcp", "version": DESCRIPTOR_VERSION, "engine_id": "scripted",
                           "host": "127.0.0.1", "port": self.listener.getsockname()[1],
                           "layout": layout.to_dict()}

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn = self.listener.accept()[0]
                self.connections += 1
                self._open.append(conn)
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, struct.error):
            for reply in [self.hello, *self.replies]:
                _, _, length = REQ.unpack(conn.recv(REQ.size, socket.MSG_WAITALL))
                conn.recv(length, socket.MSG_WAITALL)
                if reply is None:
                    conn.recv(1)  # silent until the reader hangs up
                    return
                conn.sendall(reply)

    def stop(self) -> None:
        self.listener.close()
        for conn in self._open:
            conn.close()


def test_a_producer_stalling_only_kept_connections_is_held_at_the_second_stall():
    """Fresh connections get a prompt refusal (the connection stays open for the next read),
    kept ones silence: one stall is forgiven (a kept connection may have been dropped on
    the way), the second within the hold time holds the producer."""
    refusal = REPLY.pack(1, 2) + b"no"
    scripted = ScriptedProducer(REPLY.pack(0, 0), [refusal, None])
    try:
        with consumer("tcp", LAYOUT_F32, timeout_s=1.5) as dec:
            for expect in ("refused: no", "TimeoutError", "refused: no", "TimeoutError"):
                error = read_in_thread(dec, scripted.descriptor, ("lease", "token"))
                assert isinstance(error, KVTransferError) and expect in str(error)
            with pytest.raises(KVTransferError, match="fail at once"):
                dec.read_blocks(scripted.descriptor, [3], [0], ("lease", "token"))
            assert scripted.connections == 2
    finally:
        scripted.stop()


def test_an_oversized_handshake_reply_is_refused_without_a_hold():
    scripted = ScriptedProducer(REPLY.pack(0, 1 << 20), [])
    try:
        with consumer("tcp", LAYOUT_F32, timeout_s=3.0) as dec:
            for _ in range(2):  # refused at once, and not held: the next read connects again
                with pytest.raises(KVTransferError, match="1048576-byte handshake reply"):
                    dec.read_blocks(scripted.descriptor, [3], [0], ("lease", "token"))
            assert scripted.connections == 2
    finally:
        scripted.stop()
