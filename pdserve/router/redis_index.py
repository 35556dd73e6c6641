"""Prefix index in Redis, shared by every router that points at the same Redis and key prefix.

The key schema and the scripts that keep it are in redis_scripts.py: every write is one Lua
script, atomic with respect to other routers, and none does more than one batch of events'
(at most MAX_BATCH_OPS, kv_events.py) or about DRAIN hashes' work, so that no call blocks Redis
(and every router's matches) for long.

`match()` is one round trip: a pipeline of HKEYS P:blk:<hash> for the prompt's blocks plus one
small script listing live instances; the prefix walk (stop at an instance's first miss) runs here.

No router-local truth: the only local state is an outage flag. On a Redis error (socket timeouts
are short) methods answer {} / False, count `errors`, log one warning per outage, and skip Redis
for `retry_interval_s` before trying again; redis-py reconnects by itself. After Redis restarts
empty, the next heartbeats re-register instances and `apply()` refuses batches (seq unknown) until
the publisher resyncs.

The caps of prefix_index.py hold here too: a new instance is admitted while P:instances has
fewer than `max_instances` members, and a block is stored while P:iblk:<id> has fewer than
`max_blocks_per_instance` members and P:nblocks is below `max_blocks`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from pdserve.router import redis_scripts as lua
from pdserve.router.kv_events import KVEventBatch
from pdserve.router.prefix_index import PrefixIndex, PrefixIndexConfig, check_caps
from pdserve.router.wire_names import is_instance_id

log = logging.getLogger(__name__)
DRAIN = 4096  # hashes a script call handles at most (about 20 ms of Redis time)


class RedisPrefixIndex(PrefixIndex):
    """Prefix index kept in Redis (schema in redis_scripts.py)."""

    def __init__(self, url: str = "redis://localhost:6379/0", *, key_prefix: str = "pdserve",
                 ttl_s: float = 10.0, socket_timeout_s: float = 0.1,
                 retry_interval_s: float = 0.5,
                 max_instances: int = PrefixIndexConfig.max_instances,
                 max_blocks_per_instance: int = PrefixIndexConfig.max_blocks_per_instance,
                 max_blocks: int = PrefixIndexConfig.max_blocks):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        check_caps(max_instances, max_blocks_per_instance, max_blocks)
        self.caps = (max_instances, max_blocks_per_instance, max_blocks)
        self.capped = 0
        self._capped_calls = 0
        self.url = url
        self.where = redacted(url)  # for logs: without its password
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.retry_interval_s = retry_interval_s
        self.errors = 0
        self._p = key_prefix + ":"
        # One immediate retry absorbs a pooled connection that the server closed (restart);
        # redis-py's default retries back off for seconds, which a router cannot afford.
        # Strings that are not UTF-8 (written by something else) decode to U+FFFD, which no
        # instance id or block hash holds.
        self._r = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1), decode_responses=True, encoding_errors="replace")
        self._state_lock = threading.Lock()
        self._refused_calls = 0
        self._live = lua.LIVE  # the script listing live instances (unflagged before Redis 7)
        self._down = False
        self._skip_until = 0.0

    @classmethod
    def from_config(cls, config: PrefixIndexConfig) -> RedisPrefixIndex:
        return cls(config.redis_url, key_prefix=config.key_prefix, ttl_s=config.ttl_s,
                   socket_timeout_s=config.socket_timeout_s,
                   retry_interval_s=config.retry_interval_s,
                   max_instances=config.max_instances,
                   max_blocks_per_instance=config.max_blocks_per_instance,
                   max_blocks=config.max_blocks)

    # --- events ---------------------------------------------------------------------------

    def apply(self, batch: KVEventBatch) -> bool:
        ops: list[str] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                ops.extend(f"+{h}" for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                ops.extend(f"-{h}" for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                ops.append("!")
        value = f"{batch.medium}:{batch.timestamp:.3f}"
        return self._write(lua.APPLY, batch.instance_id, batch.seq, value, ops)

    def resync(self, instance_id: str, block_hashes: Sequence[int], seq: int,
               medium: str = "gpu") -> bool:
        if seq < -1:
            raise ValueError(f"seq: must be >= -1, got {seq}")
        value = f"{medium}:{time.time():.3f}"
        parts = [block_hashes[i:i + DRAIN] for i in range(0, len(block_hashes), DRAIN)] or [[]]
        for k, part in enumerate(parts):
            which = ("whole" if len(parts) == 1 else "first" if k == 0
                     else "last" if k == len(parts) - 1 else "more")
            if not self._write(lua.RESYNC, instance_id, seq, value, [which, *part]):
                return False
        return True

    def _write(self, script: str, instance_id: str, seq: int, value: str,
               items: Sequence[Any]) -> bool:
        """Run the apply or resync script; count and log what the caps left out."""
        done, capped = self._guarded((0, 0), self._r.eval, script, 0, self._p, instance_id, seq,
                                     value, self.ttl_ms, *self.caps, *items, DRAIN)
        if capped:
            self._count_capped(capped, instance_id)
        return done == 1

    def _count_capped(self, n: int, instance_id: str) -> None:
        """Count what a cap left out; log the 1st, 2nd, 4th, ... such call (no log flood)."""
        with self._state_lock:
            self.capped += n
            self._capped_calls += 1
            calls = self._capped_calls
        if calls & (calls - 1) == 0:
            log.warning("prefix index: blocks or a new instance (%.64r) left out for the caps "
                        "(max_instances %d, max_blocks_per_instance %d, max_blocks %d); %d so "
                        "far",
                        instance_id, *self.caps, self.capped)

    # --- queries --------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        return self._guarded({}, self._match, block_hashes)

    def _match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        pipe = self._r.pipeline(transaction=False)
        pipe.eval(self._live, 0, self._p, "0")
        blk = self._p + "blk:"
        for h in block_hashes:
            pipe.hkeys(f"{blk}{h}")
        # A block key of another type is a miss, not a failed call.
        live, *holders_per_block = pipe.execute(raise_on_error=False)
        if isinstance(live, Exception):
            if self._older_redis(live):
                return self._match(block_hashes)
            raise live
        live = [i for i in live if is_instance_id(i)]  # none written by something else
        result = dict.fromkeys(live, 0)
        active = set(live)
        n = 0
        for holders in holders_per_block:
            if not active or not holders or isinstance(holders, Exception):
                break
            still = active.intersection(holders)
            for i in active.difference(still):
                result[i] = n
            active = still
            n += 1
        for i in active:
            result[i] = n
        return result

    def instances(self) -> dict[str, dict[str, Any]]:
        flat = self._guarded([], self._live_with_info)
        found = {}
        for i in range(0, len(flat), 2):
            if not is_instance_id(flat[i]):
                continue
            try:
                found[flat[i]] = json.loads(flat[i + 1])
            except ValueError:
                continue  # not written by an instance: skip it
        return found

    def _live_with_info(self) -> list[str]:
        try:
            return self._r.eval(self._live, 0, self._p, "1")
        except redis.ResponseError as e:
            if not self._older_redis(e):
                raise
            return self._r.eval(self._live, 0, self._p, "1")

    def _older_redis(self, error: Exception) -> bool:
        """Whether `error` says this Redis (before 7) cannot compile a flagged script: then
        the read-only scripts run unflagged from now on."""
        if self._live is lua.LIVE and "compil" in str(error).lower():
            self._live = lua.LIVE_ANY_VERSION
            return True
        return False

    def num_blocks(self, instance_id: str) -> int:
        return self._guarded(0, self._r.scard, f"{self._p}iblk:{instance_id}")

    # --- registry -------------------------------------------------------------------------

    def heartbeat(self, instance_id: str, info: dict[str, Any]) -> bool:
        admitted = self._guarded(1, self._r.eval, lua.HEARTBEAT, 0, self._p, instance_id,
                                 json.dumps(info), self.ttl_ms, self.caps[0], DRAIN)
        if not admitted:
            self._count_capped(1, instance_id)
        return bool(admitted)

    def remove_instance(self, instance_id: str) -> None:
        self._guarded(0, self._r.eval, lua.REMOVE, 0, self._p, instance_id, DRAIN)

    def sweep(self) -> int:
        return self._guarded(0, self._r.eval, lua.SWEEP, 0, self._p, DRAIN)

    def ping(self) -> bool:
        """One round trip to Redis; False when it is unreachable."""
        return bool(self._guarded(False, self._r.ping))

    def close(self) -> None:
        self._r.close()

    # --- outage handling ------------------------------------------------------------------

    def _guarded(self, default: Any, fn: Any, *args: Any) -> Any:
        """Run one Redis call; on failure count it and return default. An unreachable or
        busy Redis is skipped for retry_interval_s (one warning per outage); any other error
        (an answer this index cannot use) fails this call alone."""
        if self._down and time.monotonic() < self._skip_until:
            with self._state_lock:
                self.errors += 1
            return default
        try:
            out = fn(*args)
        except (redis.RedisError, OSError, ValueError) as e:
            if not _is_outage(e):
                with self._state_lock:
                    self.errors += 1
                    self._refused_calls += 1
                    calls = self._refused_calls
                if calls & (calls - 1) == 0:  # the 1st, 2nd, 4th, ... (no log flood)
                    log.warning("prefix index: a Redis call failed (%s: %.200s); %d so far",
                                type(e).__name__, e, calls)
                return default
            with self._state_lock:
                self.errors += 1
                self._skip_until = time.monotonic() + self.retry_interval_s
                first = not self._down
                self._down = True
            if first:
                log.warning("prefix index: Redis at %s failed (%s: %s); routing without prefix "
                            "information until it answers again", self.where, type(e).__name__, e)
            return default
        if self._down:
            with self._state_lock:
                was_down, self._down = self._down, False
            if was_down:
                log.warning("prefix index: Redis at %s answers again", self.where)
        return out


def _is_outage(error: BaseException) -> bool:
    """Redis unreachable, timing out, loading or busy in a script: try again later."""
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError,
                          OSError)):
        return True
    return isinstance(error, redis.ResponseError) and str(error).startswith("BUSY")


def redacted(url: str) -> str:
    """`url` without the password it may carry (redis://user:PASSWORD@host)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))
