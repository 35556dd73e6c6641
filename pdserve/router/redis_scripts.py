"""The Lua scripts of the Redis prefix index (redis_index.py), and its key schema.

Key schema (P = key prefix, "pdserve" by default; hashes are decimal ints in [0, 2^63)):

    P:blk:<hash>      HASH   instance id -> "<medium>:<timestamp>"   who holds this block, in
                             which tier ("gpu", "cpu", ...) since the batch time (Unix seconds)
    P:iblk:<id>       SET    block hashes held by instance <id> (for removal and cleanup)
    P:seq:<id>        STRING last applied KV event batch seq of <id>
    P:inst:<id>       STRING heartbeat info of <id> (JSON), PX TTL = ttl; exists <=> live
    P:nblocks         STRING (instance, block) pairs held: the sum of the P:iblk sets' sizes
    P:instances       ZSET   instance id -> deadline (Redis server ms) of every instance the
                             index knows; lapsed members are swept (all their keys removed)
    P:gone            HASH   grave key -> instance id, and '#' -> the last grave number
    P:gone:<n>        SET    block hashes an instance dropped, whose P:blk entries are still
                             to be removed (DRAIN at a time, by every write)

Every write is one Lua script, so the seq check and the writes are atomic with respect to other
routers, and deadlines come from the Redis server clock (routers' clocks may disagree). Scripts
touch keys they do not declare, so this runs on a single Redis (or a primary with replicas),
not Redis Cluster. No script does more than one batch of events' (kv_events.MAX_BATCH_OPS) or
about DRAIN hashes' work, so none blocks Redis for long: a snapshot goes in parts, and the
blocks of an instance that lapsed, was removed or cleared its cache are left in a grave that
later writes empty. Until its grave is empty, a
live instance that dropped more than DRAIN blocks at once may still be credited with some of
them: a routing miss (its prompt is computed again), never a wrong output.
"""

# ARGV[1] is the key prefix with its trailing ':', the last ARGV of a write DRAIN. Lapsed
# instances are swept by every write.
PRELUDE = """
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
-- An instance's blocks dropped at once while this call's budget of DRAIN hashes lasts; else
-- its set is renamed to a grave (one command), which later calls empty, so no call blocks
-- Redis long however many instances lapse at once.
local DRAIN = tonumber(ARGV[#ARGV])
local budget = DRAIN
local function drop_blocks(id)
  local setk = P .. 'iblk:' .. id
  own(setk, 'set')
  local n = redis.call('SCARD', setk)
  if n == 0 then return end
  if n <= budget then
    budget = budget - n
    local hs = redis.call('SMEMBERS', setk)
    for i = 1, #hs do redis.pcall('HDEL', P .. 'blk:' .. hs[i], id) end
    redis.call('DEL', setk)
  else
    own(P .. 'gone', 'hash')
    local grave = P .. 'gone:' .. redis.call('HINCRBY', P .. 'gone', '#', 1)
    redis.call('RENAME', setk, grave)
    redis.call('HSET', P .. 'gone', grave, id)
  end
  uncount(n)
end
-- Empties graves, up to DRAIN hashes a call; a hash the instance holds again stays.
local function drain()
  if redis.call('TYPE', P .. 'gone')['ok'] ~= 'hash' then return end
  local graves = redis.call('HGETALL', P .. 'gone')
  for i = 1, #graves, 2 do
    local grave, id = graves[i], graves[i + 1]
    if grave ~= '#' then
      if budget <= 0 then return end
      local hs = {}
      if redis.call('TYPE', grave)['ok'] == 'set' then hs = redis.call('SPOP', grave, budget) end
      own(P .. 'iblk:' .. id, 'set')
      for j = 1, #hs do
        if redis.call('SISMEMBER', P .. 'iblk:' .. id, hs[j]) == 0 then
          redis.pcall('HDEL', P .. 'blk:' .. hs[j], id)
        end
      end
      budget = budget - #hs
      if redis.call('EXISTS', grave) == 0 then redis.call('HDEL', P .. 'gone', grave) end
    end
  end
  if redis.call('HLEN', P .. 'gone') <= 1 then redis.call('DEL', P .. 'gone') end
end
local function forget(id)
  drop_blocks(id)
  redis.call('DEL', P .. 'seq:' .. id, P .. 'inst:' .. id)
  redis.call('ZREM', P .. 'instances', id)
end
local function sweep()
  local ids = redis.call('ZRANGEBYSCORE', P .. 'instances', '-inf', now)
  for i = 1, #ids do forget(ids[i]) end
  drain()
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
# ops... ('+h' stored, '-h' removed, '!' all cleared), DRAIN. Returns {applied (0/1), stored
# blocks or instances left out}.
APPLY = PRELUDE + """
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
for i = 9, #ARGV - 1 do
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

# ARGV: prefix, id, seq, value, ttl_ms, the three caps as apply's, part ('first', 'more',
# 'last' or 'whole'), hashes..., DRAIN. A snapshot goes in parts of at most DRAIN hashes: the
# first drops what the instance held (and its seq, so that its batches wait for the last part),
# the last sets the seq. Returns as apply.
RESYNC = PRELUDE + """
local id, val, ttl, part = ARGV[2], ARGV[4], tonumber(ARGV[5]), ARGV[9]
sweep()
if not admitted(id, tonumber(ARGV[6])) then return {0, 1} end
local seqk = P .. 'seq:' .. id
if part == 'first' or part == 'whole' then
  drop_blocks(id)
  redis.call('DEL', seqk)
elseif redis.call('EXISTS', seqk) == 1 then
  return {0, 0}  -- another snapshot finished meanwhile: this one is stale
end
local setk, maxb, maxall, capped = P .. 'iblk:' .. id, tonumber(ARGV[7]), tonumber(ARGV[8]), 0
own(setk, 'set')
for i = 10, #ARGV - 1 do
  capped = capped + store(setk, id, ARGV[i], val, maxb, maxall)
end
if part == 'last' or part == 'whole' then
  redis.call('SET', seqk, ARGV[3])
  redis.call('ZADD', P .. 'instances', 'NX', now + ttl, id)
end
return {1, capped}
"""

# ARGV: prefix, id, info json, ttl_ms, max_instances, DRAIN. Returns 0 when the instance is refused.
HEARTBEAT = PRELUDE + """
sweep()
if not admitted(ARGV[2], tonumber(ARGV[5])) then return 0 end
redis.call('SET', P .. 'inst:' .. ARGV[2], ARGV[3], 'PX', ARGV[4])
redis.call('ZADD', P .. 'instances', now + tonumber(ARGV[4]), ARGV[2])
return 1
"""

# ARGV: prefix, id, DRAIN
REMOVE = PRELUDE + "forget(ARGV[2])\nreturn 1\n"

# ARGV: prefix, DRAIN
SWEEP = PRELUDE + "return sweep()\n"

# ARGV: prefix, with_info ('1' -> id, info pairs; '0' -> ids). Read-only: flagged so on Redis
# 7+, which then runs it while writes are paused (a failover) and on replicas.
LIVE_ANY_VERSION = """
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



LIVE = "#!lua flags=no-writes\n" + LIVE_ANY_VERSION
