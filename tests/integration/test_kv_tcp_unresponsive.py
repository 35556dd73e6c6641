"""A tcp producer that accepts and never answers, or answers a byte at a time, costs a reader
one timeout: the handshake has one deadline, and after a timeout on a fresh connection reads
naming that producer fail at once for a while, so reads from other producers are not held
behind it."""

import contextlib
import os
import signal
import socket
import threading
import time

import pytest
import torch
from test_kv_transport import LAYOUT, Producer, consumer

from pdserve.kv_transfer import KVTransferError
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

    monkeypatch.setattr(tcp_transport, "UNRESPONSIVE_HOLD_S", 1.5)
    with contextlib.ExitStack() as stack:
        silent = SilentProducer()
        stack.callback(silent.stop)
        producer = Producer("tcp", LAYOUT_F32, seed=13)
        stack.callback(producer.stop)
        dec = stack.enter_context(consumer("tcp", LAYOUT_F32, timeout_s=0.5))
        error = read_in_thread(dec, silent.descriptor, ("lease", "token"))
        assert isinstance(error, KVTransferError) and "TimeoutError" in str(error)
        assert silent.connections(1) == 1
        for _ in range(3):  # held: no new connection, a clear error
            with pytest.raises(KVTransferError, match="'silent' .* fail at once"):
                dec.read_blocks(silent.descriptor, [3], [0], ("lease", "token"))
        # Other producers are read as before.
        assert dec.read_blocks(producer.descriptor, [4], [1], producer.lease) > 0
        assert torch.equal(dec.kv_cache[:, :, 1], producer.expected()[:, :, 4])
        assert silent.connections(2) == 1
        time.sleep(1.6)  # the hold ends: the next read tries the producer again
        error = read_in_thread(dec, silent.descriptor, ("lease", "token"))
        assert "TimeoutError" in str(error) and silent.connections(2) == 2


def test_a_frozen_producer_is_held_after_a_fresh_connection_times_out():
    """A producer process stopped (SIGSTOP) after a first read: the read on the cached
    connection times out without a hold (a connection dropped on the way looks the same),
    the next one opens a connection, times out in the handshake and holds the producer."""
    producer = Producer("tcp", LAYOUT_F32, seed=14)
    try:
        with consumer("tcp", LAYOUT_F32, timeout_s=0.5) as dec:
            assert dec.read_blocks(producer.descriptor, [4], [1], producer.lease) > 0
            os.kill(producer.proc.pid, signal.SIGSTOP)
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
