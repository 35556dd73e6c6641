"""No call of the Redis prefix index does more than about DRAIN hashes' work (Redis runs one
script at a time, so a long one stalls every router's matches): a snapshot goes in parts, and
the blocks an instance drops wait in a grave that later writes empty, DRAIN at a time."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from redis_fixture import RedisServer, redis_server  # noqa: F401  (session fixture)

from pdserve.engine.block_pool import AllBlocksCleared, BlockStored
from pdserve.router import redis_index
from pdserve.router.kv_events import KVEventBatch
from pdserve.router.redis_index import RedisPrefixIndex

DRAIN = 4


def batch(iid: str, seq: int, *events) -> KVEventBatch:
    return KVEventBatch(iid, seq, tuple(events), timestamp=1.0)


@pytest.fixture
def setup(redis_server: RedisServer, monkeypatch):  # noqa: F811
    monkeypatch.setattr(redis_index, "DRAIN", DRAIN)
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    index = RedisPrefixIndex(redis_server.url, key_prefix=prefix, ttl_s=30.0)
    raw = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield prefix, index, raw
    index.close()
    raw.close()


def graves(raw, prefix) -> int:
    """Hashes still waiting in graves."""
    return sum(raw.scard(k) for k in raw.keys(f"{prefix}:gone:*"))


def test_a_snapshot_in_parts_replaces_what_the_instance_held(setup):
    prefix, index, raw = setup
    assert index.heartbeat("a", {"role": "decode"}) and index.heartbeat("b", {"role": "decode"})
    old = list(range(1000, 1013))  # 13 blocks: more than DRAIN, so dropped into a grave
    assert index.resync("a", old, seq=3)  # four parts
    assert index.match(old) == {"a": 13, "b": 0}
    assert index.apply(batch("a", 4, BlockStored((5000,), None, 16)))
    new = old[:2] + list(range(2000, 2011))  # keeps two of the old blocks
    assert index.resync("a", new, seq=9)
    assert index.match(new) == {"a": 13, "b": 0}
    waiting = graves(raw, prefix)  # the old set (14 with block 5000), less what parts drained
    assert 0 < waiting <= 14 - DRAIN
    assert index.apply(batch("a", 10))  # every write empties up to DRAIN hashes of graves
    assert graves(raw, prefix) == max(waiting - DRAIN, 0)
    index.heartbeat("b", {"role": "decode"})
    assert graves(raw, prefix) == 0 and not raw.exists(f"{prefix}:gone")
    assert index.match(new) == {"a": 13, "b": 0}  # the blocks it kept survived the drain
    assert index.match(old[:3]) == {"a": 2, "b": 0}
    assert raw.hkeys(f"{prefix}:blk:{old[5]}") == [] and raw.hkeys(f"{prefix}:blk:5000") == []
    assert int(raw.get(f"{prefix}:nblocks")) == 13
    assert index.apply(batch("a", 11, BlockStored((6000,), None, 16)))  # the seq follows


def test_a_cleared_cache_and_a_lapsed_instance_leave_no_keys_in_the_end(setup):
    prefix, index, raw = setup
    index.ttl_ms = 300
    assert index.heartbeat("a", {"role": "decode"})
    hashes = tuple(range(100, 120))
    assert index.apply(batch("a", 0, BlockStored(hashes, None, 16)))
    assert index.apply(batch("a", 1, AllBlocksCleared()))
    assert graves(raw, prefix) == 20 and index.num_blocks("a") == 0
    for _ in range(5):  # until drained, the index may still credit a with them (a miss later)
        index.sweep()
    assert index.match(list(hashes)) == {"a": 0}
    assert index.apply(batch("a", 2, BlockStored(hashes[:9], None, 16)))
    time.sleep(0.4)  # a lapses, holding 9 blocks: forgotten into a grave at the next write
    for _ in range(12):
        index.sweep()
    assert raw.keys(f"{prefix}:*") == []


def test_many_instances_lapsing_at_once_share_one_calls_budget(setup):
    """Each lapsed instance's few blocks would be quick alone; together they are bounded too:
    past DRAIN hashes in a call, the rest wait in graves for later calls."""
    prefix, index, raw = setup
    index.ttl_ms = 300
    for k in range(6):
        assert index.heartbeat(f"i{k}", {"role": "decode"})
        assert index.apply(batch(f"i{k}", 0, BlockStored((100 * k + 1, 100 * k + 2, 100 * k + 3),
                                                         None, 48)))
    time.sleep(0.4)
    assert index.sweep() == 6
    assert graves(raw, prefix) == 6 * 3 - DRAIN  # one instance's 3 dropped, 1 drained
    for _ in range(5):
        index.sweep()
    assert raw.keys(f"{prefix}:*") == []
