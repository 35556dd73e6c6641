"""Producers that let a read time out: further reads from them fail at once, for a while.

An engine reads its KV loads one at a time. A producer that accepts a connection and never
answers (stopped, swamped, or hostile) would hold each later read naming it for a whole
timeout, and every other producer's reads queue behind. After a timeout on a connection opened
for the read (or a second one within `hold_s` on a connection kept from earlier reads), the
producer is held for `hold_s`: reads naming it fail at once (the scheduler then recomputes the
prompt or fails the request, as for any failed load), and one read tries it again afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable

from pdserve.kv_transfer.errors import KVTransferError


class UnresponsivePeers:
    """Peers (any hashable key) that timed out, each held until a monotonic time; at most
    `capacity` are remembered (descriptors may name any address), the oldest forgotten first."""

    def __init__(self, hold_s: float, capacity: int = 256) -> None:
        self.hold_s = float(hold_s)
        self.capacity = int(capacity)
        self._until: dict[Hashable, float] = {}  # held until
        self._doubted: dict[Hashable, float] = {}  # a timeout that may not be theirs, when
        self._lock = threading.Lock()

    def check(self, key: Hashable, name: str) -> None:
        """KVTransferError naming `name` while `key` is held; nothing otherwise."""
        with self._lock:
            until = self._until.get(key)
            if until is None:
                return
            left = until - time.monotonic()
            if left <= 0:
                del self._until[key]
                return
        raise KVTransferError(f"{name} timed out on an earlier read: reads from it fail at "
                              f"once for {left:.1f} s more")

    def mark(self, key: Hashable, sure: bool = True) -> None:
        """Hold `key` for hold_s from now. A timeout that may not be the peer's doing (`sure`
        False: on a connection that may have been dropped on the way) holds it only when
        another such came within hold_s before."""
        now = time.monotonic()
        with self._lock:
            if not sure:
                before = self._doubted.pop(key, None)
                if before is None or now - before > self.hold_s:
                    self._remember(self._doubted, key, now)
                    return
            self._doubted.pop(key, None)
            self._remember(self._until, key, now + self.hold_s)

    def _remember(self, table: dict[Hashable, float], key: Hashable, value: float) -> None:
        table.pop(key, None)
        while len(table) >= self.capacity:
            del table[next(iter(table))]
        table[key] = value
