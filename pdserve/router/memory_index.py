"""In-process prefix index (the default backend): dictionaries behind one lock.

Per block hash the set of instances holding it, as a bit mask over instance slots (what
`match()` reads, O(prompt blocks)); per instance its blocks and their medium (what removal and
cleanup read). The contract is in prefix_index.py.

NOTE: masks are plain ints, not sets, so a large index holds no objects the garbage collector
must walk: with 100,000 blocks as sets, a full collection paused the router for ~25 ms.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from pdserve.router.kv_events import KVEventBatch
from pdserve.router.prefix_index import PrefixIndex, PrefixIndexConfig, check_caps

log = logging.getLogger(__name__)


class MemoryPrefixIndex(PrefixIndex):
    """Prefix index held in this process; `clock` is monotonic seconds (injectable for tests)."""

    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic, *,
                 max_instances: int = PrefixIndexConfig.max_instances,
                 max_blocks_per_instance: int = PrefixIndexConfig.max_blocks_per_instance,
                 max_blocks: int = PrefixIndexConfig.max_blocks):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        check_caps(max_instances, max_blocks_per_instance, max_blocks)
        self.ttl_s = ttl_s
        self.max_instances = max_instances
        self.max_blocks_per_instance = max_blocks_per_instance
        self.max_blocks = max_blocks
        self._entries = 0  # (instance, block) pairs held: the sum of len(self._blocks[i])
        self.errors = 0  # never anything to swallow in memory; kept for the common interface
        self.capped = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[int, int] = {}  # block hash -> mask of the slots holding it
        self._slot: dict[str, int] = {}  # instance -> its bit in the masks
        self._slot_owner: list[str | None] = []  # slot -> instance (None: free)
        self._blocks: dict[str, dict[int, str]] = {}  # instance -> {block hash: medium}
        self._seq: dict[str, int] = {}  # instance -> last applied seq
        # NOTE: every instance the index knows anything about has a deadline here; it is live
        # while the deadline is in the future AND it has heartbeat info.
        self._deadline: dict[str, float] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._next_sweep = 0.0
        self._warned: set[str] = set()  # instances whose blocks reached the cap (logged once)
        self._refusals = 0  # new instances refused for max_instances

    # --- events ---------------------------------------------------------------------------

    def apply(self, batch: KVEventBatch) -> bool:
        iid, seq = batch.instance_id, batch.seq
        with self._lock:
            now = self._clock()
            self._forget_if_lapsed(iid, now)
            if not self._admit(iid, now):
                return False
            last = self._seq.get(iid)
            if seq == last:
                return True  # duplicate delivery
            if seq == 0:
                self._drop_blocks(iid)
            elif last is None or seq != last + 1:
                return False
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._add(iid, event.block_hashes, batch.medium)
                elif isinstance(event, BlockRemoved):
                    self._remove(iid, event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self._drop_blocks(iid)
            self._seq[iid] = seq
            self._deadline.setdefault(iid, now + self.ttl_s)
            self._maybe_sweep(now)
            return True

    def resync(self, instance_id: str, block_hashes: Sequence[int], seq: int,
               medium: str = "gpu") -> bool:
        if seq < -1:
            raise ValueError(f"seq: must be >= -1, got {seq}")
        with self._lock:
            now = self._clock()
            self._forget_if_lapsed(instance_id, now)
            if not self._admit(instance_id, now):
                return False
            self._drop_blocks(instance_id)
            self._add(instance_id, block_hashes, medium)
            self._seq[instance_id] = seq
            self._deadline.setdefault(instance_id, now + self.ttl_s)
            return True

    # --- queries --------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        with self._lock:
            now = self._clock()
            result = {i: 0 for i, d in self._deadline.items() if d > now and i in self._info}
            active = 0
            for i in result:
                active |= 1 << self._slot_of(i)
            n = 0
            for h in block_hashes:
                if not active:
                    break
                still = active & self._holders.get(h, 0)
                self._record(result, active ^ still, n)
                active = still
                n += 1
            self._record(result, active, n)
            return result

    def _record(self, result: dict[str, int], mask: int, n: int) -> None:
        while mask:
            low = mask & -mask
            result[self._slot_owner[low.bit_length() - 1]] = n  # type: ignore[index]
            mask ^= low

    def instances(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            now = self._clock()
            return {i: dict(info) for i, info in self._info.items() if self._deadline[i] > now}

    def num_blocks(self, instance_id: str) -> int:
        with self._lock:
            return len(self._blocks.get(instance_id, ()))

    # --- registry -------------------------------------------------------------------------

    def heartbeat(self, instance_id: str, info: dict[str, Any]) -> bool:
        with self._lock:
            now = self._clock()
            self._forget_if_lapsed(instance_id, now)
            if not self._admit(instance_id, now):
                return False
            self._info[instance_id] = dict(info)
            self._slot_of(instance_id)
            self._deadline[instance_id] = now + self.ttl_s
            self._maybe_sweep(now)
            return True

    def remove_instance(self, instance_id: str) -> None:
        with self._lock:
            self._forget(instance_id)

    def sweep(self) -> int:
        with self._lock:
            return self._sweep(self._clock())

    # --- internals (caller holds the lock) ------------------------------------------------

    def _slot_of(self, iid: str) -> int:
        slot = self._slot.get(iid)
        if slot is None:
            free = [k for k, owner in enumerate(self._slot_owner) if owner is None]
            slot = free[0] if free else len(self._slot_owner)
            if not free:
                self._slot_owner.append(None)
            self._slot_owner[slot] = iid
            self._slot[iid] = slot
        return slot

    def _admit(self, iid: str, now: float) -> bool:
        """True when the index knows `iid` or has room for one more instance."""
        if iid in self._deadline or len(self._deadline) < self.max_instances:
            return True
        self._sweep(now)
        if len(self._deadline) < self.max_instances:
            return True
        self.capped += 1
        self._refusals += 1
        if self._refusals & (self._refusals - 1) == 0:  # the 1st, 2nd, 4th, ...: no log flood
            log.warning("prefix index: refused instance %.64r, the index already knows %d "
                        "(max_instances); %d refusals so far", iid, self.max_instances,
                        self._refusals)
        return False

    def _add(self, iid: str, hashes: Sequence[int], medium: str) -> None:
        mine = self._blocks.setdefault(iid, {})
        bit = 1 << self._slot_of(iid)
        holders = self._holders
        room = min(self.max_blocks_per_instance - len(mine), self.max_blocks - self._entries)
        added = 0
        for h in hashes:
            if h not in mine:
                if added >= room:
                    self.capped += 1
                    self._warn_full(iid)
                    continue
                added += 1
            mine[h] = medium
            holders[h] = holders.get(h, 0) | bit
        self._entries += added

    def _warn_full(self, iid: str) -> None:
        if iid not in self._warned:
            self._warned.add(iid)
            log.warning("prefix index: instance %.64r holds %d blocks, all instances %d "
                        "(max_blocks_per_instance %d, max_blocks %d); further blocks it stores "
                        "are left out", iid, len(self._blocks.get(iid, ())), self._entries,
                        self.max_blocks_per_instance, self.max_blocks)

    def _remove(self, iid: str, hashes: Sequence[int]) -> None:
        mine = self._blocks.get(iid)
        if not mine:
            return
        for h in hashes:
            if mine.pop(h, None) is not None:
                self._entries -= 1
                self._unhold(iid, h)

    def _drop_blocks(self, iid: str) -> None:
        mine = self._blocks.pop(iid, {})
        self._entries -= len(mine)
        for h in mine:
            self._unhold(iid, h)

    def _unhold(self, iid: str, h: int) -> None:
        mask = self._holders[h] & ~(1 << self._slot[iid])
        if mask:
            self._holders[h] = mask
        else:
            del self._holders[h]

    def _forget(self, iid: str) -> None:
        self._drop_blocks(iid)
        self._seq.pop(iid, None)
        self._deadline.pop(iid, None)
        self._info.pop(iid, None)
        self._warned.discard(iid)
        slot = self._slot.pop(iid, None)
        if slot is not None:  # NOTE: its bits were cleared with its blocks, so reuse is safe
            self._slot_owner[slot] = None

    def _forget_if_lapsed(self, iid: str, now: float) -> None:
        deadline = self._deadline.get(iid)
        if deadline is not None and deadline <= now:
            self._forget(iid)

    def _sweep(self, now: float) -> int:
        lapsed = [i for i, d in self._deadline.items() if d <= now]
        for i in lapsed:
            self._forget(i)
        self._next_sweep = now + self.ttl_s / 2
        return len(lapsed)

    def _maybe_sweep(self, now: float) -> None:
        if now >= self._next_sweep:
            self._sweep(now)
