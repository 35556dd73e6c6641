"""The block pool: owner of physical KV blocks, their reference counts, the LRU free list and
the hash -> block map of the prefix cache.

A block with ref count 0 sits in the free list but keeps its hash (and so its cached KV) until
it is handed out again: freeing makes a block evictable, allocation evicts the least recently
freed one. Callers free a request's blocks tail first, so a prompt's last blocks go before its
first ones. The pool never reads request internals.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """KV event: blocks joined the prefix cache (hashes in order, chained from parent_hash)."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    num_tokens: int


@dataclass(frozen=True)
class BlockRemoved:
    """KV event: blocks left the prefix cache."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """KV event: the whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    """Physical blocks 0..num_blocks-1 with ref counts, LRU eviction and a prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # NOTE: every block with ref count 0 is in `free`, ordered least recently freed first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.events: list[KVEvent] = []
        self.num_queries = 0
        self.num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (0..1)."""
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, block_hashes: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of `block_hashes` (does not take them)."""
        hits = []
        for h in block_hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        self.num_queries += len(block_hashes)
        self.num_hits += len(hits)
        return hits

    def num_evictable(self, block_ids: list[int]) -> int:
        """How many of `block_ids` currently sit in the free list."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on blocks that are already allocated or cached."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks off the free list, evicting their cached contents."""
        if n > len(self.free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            self._evict(b)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become evictable, in order."""
        for b in block_ids:
            count = self.ref_counts[b] - 1
            if count < 0:
                raise RuntimeError(f"block {b} released more often than taken")
            self.ref_counts[b] = count
            if count == 0:
                self.free[b] = None

    def cache(self, block_ids: list[int], block_hashes: list[int], parent_hash: int | None,
              block_size: int) -> None:
        """Record full blocks in the prefix cache under their chained hashes."""
        if not self.enable_caching:
            return
        stored = []
        for b, h in zip(block_ids, block_hashes):
            if self.block_hash[b] is not None:
                continue
            self.block_hash[b] = h
            if h not in self.cached:  # NOTE: a duplicate block keeps no map entry
                self.cached[h] = b
                stored.append(h)
        if stored and self.record_events:
            self.events.append(BlockStored(tuple(stored), parent_hash, len(stored) * block_size))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if len(self.free) != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is None:
            return
        self.block_hash[b] = None
        if self.cached.get(h) == b:
            del self.cached[h]
            if self.record_events:
                self.events.append(BlockRemoved((h,)))
