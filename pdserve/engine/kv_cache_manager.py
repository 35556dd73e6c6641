"""Per-request block tables over the block pool.

The manager answers questions (which prefix is cached, can these tokens get slots) and keeps
each request's block table; it returns values and never changes a request's counters.
"""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps request ids to the physical blocks that hold their KV."""

    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool = True):
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Blocks of finished prefills kept for a remote reader: request id -> (blocks, deadline).
        self.leases: dict[str, tuple[list[int], float]] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks matching the request's prefix, and the tokens they cover.

        At least one token is always left to compute, since its logits are needed.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.pool.lookup(request.block_hashes[:max_blocks])
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Give the request room for `num_new_tokens` more tokens after its computed ones.

        `computed_blocks` are prefix-cache hits to adopt first (only at first scheduling).
        Returns the newly allocated blocks, or None (nothing changed) if the pool is short.
        """
        computed_blocks = computed_blocks or []
        table = self.block_tables.get(request.request_id, [])
        num_tokens = (request.num_computed_tokens + len(computed_blocks) * self.block_size
                      + num_new_tokens)
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(table) - len(computed_blocks)
        available = self.pool.num_free_blocks - self.pool.num_evictable(computed_blocks)
        if num_new_blocks > available:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(max(num_new_blocks, 0))
        table = table + computed_blocks + new_blocks
        self.block_tables[request.request_id] = table
        if computed_blocks:
            self.num_cached_blocks[request.request_id] = len(computed_blocks)
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Enter the request's full, computed blocks into the prefix cache."""
        rid = request.request_id
        done = self.num_cached_blocks.get(rid, 0)
        full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        if full <= done:
            return
        parent = request.block_hashes[done - 1] if done else None
        self.pool.cache(self.block_tables[rid][done:full], request.block_hashes[done:full],
                        parent, self.block_size)
        self.num_cached_blocks[rid] = full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its prefix stays cached longest."""
        table = self.block_tables.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.release(list(reversed(table)))

    def lease(self, request: Request, deadline: float) -> list[int]:
        """Keep a finished request's blocks pinned for a reader until released or `deadline`
        (time.monotonic()); returns the pinned blocks."""
        table = self.block_tables.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.leases[request.request_id] = (table, deadline)
        return table

    def release_lease(self, request_id: str) -> bool:
        """Free a lease's blocks; False if there was no such lease (released or expired)."""
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return False
        self.pool.release(list(reversed(lease[0])))
        return True

    def expire_leases(self, now: float) -> list[str]:
        """Free every lease whose deadline passed; returns their request ids."""
        expired = [rid for rid, (_, deadline) in self.leases.items() if deadline <= now]
        for rid in expired:
            self.release_lease(rid)
        return expired

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self.block_tables

    @property
    def num_requests(self) -> int:
        """Requests holding blocks, leased ones included."""
        return len(self.block_tables) + len(self.leases)
