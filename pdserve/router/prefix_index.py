"""The prefix index: which instance holds which prefix-cache blocks, and which instances are live.

Engines publish KV events (`KVEventBatch`) and heartbeats; the router asks `match()` how many
leading blocks of a prompt each live instance already holds. Backends: `MemoryPrefixIndex`
(in-process, the default) and `RedisPrefixIndex` (shared by several routers).

Contract shared by every backend (tests/integration/test_prefix_index.py checks it):

- Batches of one instance must arrive in seq order. `apply()` applies a batch whose seq is the
  last applied + 1, or 0 (a fresh instance: what was known about it is dropped first). A batch
  equal to the last applied seq is a duplicate and is ignored (returns True). Anything else (a
  gap, a seq that went backwards, or an instance whose seq is unknown) applies nothing and
  returns False: the caller must `resync()` that instance from a snapshot.
- An instance is live while its heartbeat is fresh (`ttl_s`). A lapsed instance stops counting
  in `match()` and `instances()` at once; its entries are removed by `sweep()`, which the
  backends also run by themselves from `heartbeat()`/`apply()` at most every `ttl_s / 2`. A
  lapsed instance that comes back starts from nothing and must resync (or send seq 0).
- Events may arrive before an instance's first heartbeat; they are kept for one `ttl_s`, and
  count in `match()` once the heartbeat arrives.
- Bounded: the index knows at most `max_instances` instances (live, lapsed but not yet swept,
  or heard from only through events). A new one beyond that is refused: `apply()`,
  `resync()` and `heartbeat()` return False and record nothing. An instance is credited with
  at most `max_blocks_per_instance` blocks, and all instances together with `max_blocks`;
  further stored blocks are left out (a real engine's cache is far smaller, so only a faulty or
  hostile publisher is under-credited, which costs routing quality and nothing else). The
  caps count what they leave out in `capped`.
- Methods never raise for backend trouble (e.g. Redis down): `match()` and `instances()` return
  {}, `apply()` and `resync()` return False, and the backend counts the failure in `errors`.
  So a publisher's loop heals itself: `if not index.apply(batch): index.resync(...)`, again on
  every later batch until a resync is taken.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.router.kv_events import KVEventBatch


KEY_PREFIX = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class PrefixIndexConfig:
    """Which backend, and how long a heartbeat keeps an instance live."""

    backend: str = "memory"  # "memory" or "redis"
    redis_url: str = "redis://localhost:6379/0"
    key_prefix: str = "pdserve"  # namespace of every Redis key, so deployments can share a Redis
    ttl_s: float = 10.0  # heartbeats should come every ttl_s / 3 or faster
    # Redis calls give up after this long, so an outage costs the router milliseconds, not seconds.
    socket_timeout_s: float = 0.1
    # After a failed Redis call, skip Redis for this long (answering {} / False) before retrying.
    retry_interval_s: float = 0.5
    # Bounds on what publishers can make the index hold (see the contract above).
    max_instances: int = 1024
    max_blocks_per_instance: int = 1 << 20  # 16M tokens at 16 a block
    max_blocks: int = 1 << 22  # all instances together: about 600 MB in the router's memory

    def __post_init__(self) -> None:
        if self.backend not in ("memory", "redis"):
            raise ValueError(f"prefix index backend must be 'memory' or 'redis', "
                             f"got {self.backend!r}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {self.ttl_s}")
        if self.socket_timeout_s <= 0 or self.retry_interval_s < 0:
            raise ValueError("socket_timeout_s must be positive and retry_interval_s >= 0")
        if not isinstance(self.key_prefix, str) or not KEY_PREFIX.fullmatch(self.key_prefix):
            raise ValueError(f"redis_key_prefix: expected 1-64 letters, digits or '._-', got "
                             f"{str(self.key_prefix)[:40]!r}")
        check_caps(self.max_instances, self.max_blocks_per_instance, self.max_blocks)


def add_redis_prefix_arg(parser) -> None:
    """--redis-key-prefix, for the router and the instances that share a Redis index."""
    parser.add_argument("--redis-key-prefix", default=PrefixIndexConfig.key_prefix,
                        help="namespace of the index's Redis keys: clusters that share one "
                             "Redis need different ones (their instance ids may collide)")


def check_caps(max_instances: int, max_blocks_per_instance: int, max_blocks: int) -> None:
    """ValueError naming the cap that is not a positive int."""
    for name, value in (("max_instances", max_instances),
                        ("max_blocks_per_instance", max_blocks_per_instance),
                        ("max_blocks", max_blocks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be an int >= 1, got {value!r}")


class PrefixIndex(ABC):
    """Block hash -> holding instances, plus the registry of live instances."""

    errors: int = 0  # backend failures swallowed so far (a metric)
    capped: int = 0  # stored blocks and new instances refused for a cap so far (a metric)

    @abstractmethod
    def apply(self, batch: KVEventBatch) -> bool:
        """Apply one batch of an instance's KV events; False means: resync this instance."""

    @abstractmethod
    def resync(self, instance_id: str, block_hashes: Sequence[int], seq: int,
               medium: str = "gpu") -> bool:
        """Replace all that is known about an instance with a snapshot taken after batch `seq`
        (-1 when it has sent none): the next batch expected from it is seq + 1. False when the
        backend could not take it (try again, e.g. when the next batch is refused)."""

    @abstractmethod
    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each live instance, how many leading blocks of the prompt it holds (0 if none)."""

    @abstractmethod
    def heartbeat(self, instance_id: str, info: dict[str, Any]) -> bool:
        """Mark an instance live for ttl_s more and store its info (role, address, load);
        False when a cap refused a new instance (True while the backend is down)."""

    @abstractmethod
    def instances(self) -> dict[str, dict[str, Any]]:
        """Live instances and the info from their latest heartbeat."""

    @abstractmethod
    def remove_instance(self, instance_id: str) -> None:
        """Forget an instance now: its registration, blocks and seq."""

    @abstractmethod
    def sweep(self) -> int:
        """Remove the entries of lapsed instances; returns how many instances were removed."""

    @abstractmethod
    def num_blocks(self, instance_id: str) -> int:
        """How many blocks the index records for an instance (live or not)."""

    def close(self) -> None:
        """Release connections; the default has none."""


def create_prefix_index(config: PrefixIndexConfig | None = None) -> PrefixIndex:
    """Build the configured backend (Redis is imported only when asked for)."""
    config = config or PrefixIndexConfig()
    if config.backend == "redis":
        from pdserve.router.redis_index import RedisPrefixIndex

        return RedisPrefixIndex.from_config(config)
    from pdserve.router.memory_index import MemoryPrefixIndex

    return MemoryPrefixIndex(ttl_s=config.ttl_s, max_instances=config.max_instances,
                             max_blocks_per_instance=config.max_blocks_per_instance,
                             max_blocks=config.max_blocks)
