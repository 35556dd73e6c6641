"""Prefix index in Redis, shared by every router that points at the same Redis and key prefix.

Key schema (P = key prefix, "pdserve" by default; hashes are decimal ints in [0, 2^63)):

    P:blk:<hash>      HASH   instance id -> "<medium>:<timestamp>"   who holds this block, in
                             which tier ("gpu", "cpu", ...) since the batch time (Unix seconds)
    P:iblk:<id>       SET    block hashes held by instance <id> (for removal and cleanup)
    P:seq:<id>        STRING last applied KV event batch seq of <id>
    P:inst:<id>       STRING heartbeat info of <id> (JSON), PX TTL = ttl; exists <=> live
    P:nblocks         STRING (instance, block) pairs held: the sum of the P:iblk sets' sizes
    P:instances       ZSET   instance id -> deadline (Redis server ms) of every instance the
                             index knows; lapsed members are swept (all their keys removed)

Every write is one Lua script, so the seq check and the writes are atomic with respect to other
routers, and deadlines come from the Redis server clock (routers' clocks may disagree). Scripts
touch keys they do not declare, so this runs on a single Redis (or a primary with replicas),
not Redis Cluster. Sweeping a lapsed instance with many blocks blocks Redis for a few ms per
10,000 blocks, once.

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
from pdserve.router.kv_events import KVEventBatch
from pdserve.router.prefix_index import PrefixIndex, PrefixIndexConfig, check_caps
from pdserve.router.wire_names import is_instance_id

log = logging.getLogger(__name__)

# ARGV[1] is the key prefix with its trailing ':'. Lapsed instances are swept by every write.
_LUA_PRELUDE = """
local P = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Keys under P of another type than the schema's (written by something else) are dropped
-- before use, and a block hash that is not a hash is replaced, so that no foreign key can make
-- every call fail.
local function own(key, kind)
  local t = redis.call('TYPE', key)['ok']
  if t ~= kind and t ~= 'none' then redis.call('DEL', key) end
end
own(P .. 'instances', 'zset')
own(P .. 'nblocks', 'string')
local function hset(key, field, value)
  local r = redis.pcall('HSET', key, field, value)
  if type(r) == 'table' and r['err'] then
    redis.call('DEL', key)
    redis.call('HSET', key, field, value)
  end
end
local recount
local function uncount(n)  -- P:nblocks goes when it reaches 0, so a swept index leaves no key
  local left = redis.pcall('DECRBY', P .. 'nblocks', n)
  if type(left) == 'table' then recount()  -- not a number: count again
  elseif left <= 0 then redis.call('DEL', P .. 'nblocks') end
end
local function drop_blocks(id)
  local setk = P .. 'iblk:' .. id
  own(setk, 'set')
  local hs = redis.call('SMEMBERS', setk)
  for i = 1, #hs do redis.pcall('HDEL', P .. 'blk:' .. hs[i], id) end
  redis.call('DEL', setk)
  if #hs > 0 then uncount(#hs) end
end
local function forget(id)
  drop_blocks(id)
  redis.call('DEL', P .. 'seq:' .. id, P .. 'inst:' .. id)
  redis.call('ZREM', P .. 'instances', id)
end
local function sweep()
  local ids = redis.call('ZRANGEBYSCORE', P .. 'instances', '-inf', now)
  for i = 1, #ids do forget(ids[i]) end
  return #ids
end
local function admitted(id, max_instances)
  if redis.call('ZSCORE', P .. 'instances', id) then return true end
  return redis.call('ZCARD', P .. 'instances') < max_instances
end
-- P:nblocks counted again from the instances' sets (once a call, when it says full: a writer
-- of an older version, or an evicted key, may have left it too high).
local recounted = false
recount = function()
  recounted = true
  local ids, n = redis.call('ZRANGE', P .. 'instances', 0, -1), 0
  for i = 1, #ids do
    own(P .. 'iblk:' .. ids[i], 'set')
    n = n + redis.call('SCARD', P .. 'iblk:' .. ids[i])
  end
  if n > 0 then redis.call('SET', P .. 'nblocks', n) else redis.call('DEL', P .. 'nblocks') end
  return n
end
-- Records that id holds block h, unless that would take it past maxb blocks, or all instances
-- past maxall: returns 1 then. P:nblocks counts (instance, block) pairs.
local function store(setk, id, h, val, maxb, maxall)
  if redis.call('SISMEMBER', setk, h) == 0 then
    if redis.call('SCARD', setk) >= maxb then return 1 end
    local total = tonumber(redis.call('GET', P .. 'nblocks') or '0')
    if total == nil or (total >= maxall and not recounted) then total = recount() end
    if total >= maxall then return 1 end
    redis.call('SADD', setk, h)
    redis.call('INCR', P .. 'nblocks')
  end
  hset(P .. 'blk:' .. h, id, val)
  return 0
end
local function unstore(setk, id, h)
  redis.pcall('HDEL', P .. 'blk:' .. h, id)
  if redis.call('SREM', setk, h) == 1 then uncount(1) end
end
"""

# ARGV: prefix, id, seq, value, ttl_ms, max_instances, max_blocks_per_instance, max_blocks,
# ops... ('+h' stored, '-h' removed, '!' all cleared). Returns {applied (0/1), stored blocks or
# instances left out}.
_LUA_APPLY = _LUA_PRELUDE + """
local id, seq, val, ttl = ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
sweep()
if not admitted(id, tonumber(ARGV[6])) then return {0, 1} end
local seqk = P .. 'seq:' .. id
own(seqk, 'string')
own(P .. 'iblk:' .. id, 'set')
local last = redis.call('GET', seqk)
if last then last = tonumber(last) end  -- not a number: unknown, as when absent
if last and seq == last then return {1, 0} end
if seq == 0 then
  drop_blocks(id)
elseif not last or seq ~= last + 1 then
  return {0, 0}
end
local setk, maxb, maxall, capped = P .. 'iblk:' .. id, tonumber(ARGV[7]), tonumber(ARGV[8]), 0
for i = 9, #ARGV do
  local op = ARGV[i]
  local c, h = string.sub(op, 1, 1), string.sub(op, 2)
  if c == '+' then
    capped = capped + store(setk, id, h, val, maxb, maxall)
  elseif c == '-' then
    unstore(setk, id, h)
  else
    drop_blocks(id)
  end
end
redis.call('SET', seqk, ARGV[3])
redis.call('ZADD', P .. 'instances', 'NX', now + ttl, id)
return {1, capped}
"""

# ARGV: prefix, id, seq, value, ttl_ms, the three caps as apply's, hashes... Returns as apply.
_LUA_RESYNC = _LUA_PRELUDE + """
local id, val, ttl = ARGV[2], ARGV[4], tonumber(ARGV[5])
sweep()
if not admitted(id, tonumber(ARGV[6])) then return {0, 1} end
drop_blocks(id)
local setk, maxb, maxall, capped = P .. 'iblk:' .. id, tonumber(ARGV[7]), tonumber(ARGV[8]), 0
for i = 9, #ARGV do
  capped = capped + store(setk, id, ARGV[i], val, maxb, maxall)
end
redis.call('SET', P .. 'seq:' .. id, ARGV[3])
redis.call('ZADD', P .. 'instances', 'NX', now + ttl, id)
return {1, capped}
"""

# ARGV: prefix, id, info json, ttl_ms, max_instances. Returns 0 when the instance is refused.
_LUA_HEARTBEAT = _LUA_PRELUDE + """
sweep()
if not admitted(ARGV[2], tonumber(ARGV[5])) then return 0 end
redis.call('SET', P .. 'inst:' .. ARGV[2], ARGV[3], 'PX', ARGV[4])
redis.call('ZADD', P .. 'instances', now + tonumber(ARGV[4]), ARGV[2])
return 1
"""

# ARGV: prefix, id
_LUA_REMOVE = _LUA_PRELUDE + "forget(ARGV[2])\nreturn 1\n"

# ARGV: prefix
_LUA_SWEEP = _LUA_PRELUDE + "return sweep()\n"

# ARGV: prefix, with_info ('1' -> id, info pairs; '0' -> ids). Read-only.
_LUA_LIVE = """
local P = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.pcall('ZRANGEBYSCORE', P .. 'instances', '(' .. now, '+inf')
if ids['err'] then return {} end  -- not a sorted set: the next write replaces it
local out = {}
for i = 1, #ids do
  local info = redis.pcall('GET', P .. 'inst:' .. ids[i])
  if type(info) == 'string' then
    out[#out + 1] = ids[i]
    if ARGV[2] == '1' then out[#out + 1] = info end
  end
end
return out
"""


class RedisPrefixIndex(PrefixIndex):
    """Prefix index kept in Redis (schema in the module docstring)."""

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
        return self._write(_LUA_APPLY, batch.instance_id, batch.seq, value, ops)

    def resync(self, instance_id: str, block_hashes: Sequence[int], seq: int,
               medium: str = "gpu") -> bool:
        if seq < -1:
            raise ValueError(f"seq: must be >= -1, got {seq}")
        value = f"{medium}:{time.time():.3f}"
        return self._write(_LUA_RESYNC, instance_id, seq, value, block_hashes)

    def _write(self, script: str, instance_id: str, seq: int, value: str,
               items: Sequence[Any]) -> bool:
        """Run the apply or resync script; count and log what the caps left out."""
        done, capped = self._guarded((0, 0), self._r.eval, script, 0, self._p, instance_id, seq,
                                     value, self.ttl_ms, *self.caps, *items)
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
        pipe.eval(_LUA_LIVE, 0, self._p, "0")
        blk = self._p + "blk:"
        for h in block_hashes:
            pipe.hkeys(f"{blk}{h}")
        # A block key of another type is a miss, not a failed call.
        live, *holders_per_block = pipe.execute(raise_on_error=False)
        if isinstance(live, Exception):
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
        flat = self._guarded([], self._r.eval, _LUA_LIVE, 0, self._p, "1")
        found = {}
        for i in range(0, len(flat), 2):
            if not is_instance_id(flat[i]):
                continue
            try:
                found[flat[i]] = json.loads(flat[i + 1])
            except ValueError:
                continue  # not written by an instance: skip it
        return found

    def num_blocks(self, instance_id: str) -> int:
        return self._guarded(0, self._r.scard, f"{self._p}iblk:{instance_id}")

    # --- registry -------------------------------------------------------------------------

    def heartbeat(self, instance_id: str, info: dict[str, Any]) -> bool:
        admitted = self._guarded(1, self._r.eval, _LUA_HEARTBEAT, 0, self._p, instance_id,
                                 json.dumps(info), self.ttl_ms, self.caps[0])
        if not admitted:
            self._count_capped(1, instance_id)
        return bool(admitted)

    def remove_instance(self, instance_id: str) -> None:
        self._guarded(0, self._r.eval, _LUA_REMOVE, 0, self._p, instance_id)

    def sweep(self) -> int:
        return self._guarded(0, self._r.eval, _LUA_SWEEP, 0, self._p)

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
