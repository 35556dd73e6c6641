"""No call of the Redis prefix index does more than about DRAIN hashes' work (Redis runs one
script at a time, so a long one stalls every router's matches): a snapshot goes in parts, the
blocks an instance drops wait in a grave that later writes empty, DRAIN at a time, and a
publisher sends more events than one batch may hold in several."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from redis_fixture import RedisServer, redis_server  # noqa: F401  (session fixture)

from pdserve.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from pdserve.proto.pdserve.v1 import router_pb2
from pdserve.router import redis_index
from pdserve.router.kv_events import (MAX_BATCH_OPS, KVEventBatch, KVEventSequencer, count_ops,
                                      event_to_dict)
from pdserve.router.kv_events_wire import batch_from_proto, batch_to_proto
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


def test_events_beyond_one_batch_go_in_several_and_an_oversized_batch_is_refused(
        redis_server: RedisServer) -> None:  # noqa: F811
    """A 10,000-block prompt stored and half of it evicted in one interval: the sequencer cuts
    the events into consecutive batches of at most MAX_BATCH_OPS hashes, the stored parts
    chained, and Redis ends up with what the unsplit events say. One batch more than the
    limit cannot be built, from JSON or from protobuf."""
    index = RedisPrefixIndex(redis_server.url, key_prefix=f"test-{uuid.uuid4().hex[:8]}")
    assert index.heartbeat("a", {"role": "decode"})
    chain = list(range(10_000, 20_000))
    events = [BlockStored(tuple(chain), 7, 16 * len(chain)), BlockRemoved(tuple(chain[5000:])),
              AllBlocksCleared(), BlockStored(tuple(chain[:2000]), 7, 16 * 2000)]
    sequencer = KVEventSequencer("a")
    batches = sequencer.batches([BlockStored((1,), None, 16)]) + sequencer.batches(events)
    assert [b.seq for b in batches] == list(range(6))  # 1 + ceil(17,001 / 4,096)
    assert all(count_ops(b.events) <= MAX_BATCH_OPS for b in batches)
    stored = [e for b in batches[1:] for e in b.events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == chain + chain[:2000]
    assert sum(e.num_tokens for e in stored) == 16 * 12_000
    for before, after in zip(stored, stored[1:]):  # each part chains from the one before
        if after.block_hashes[0] != chain[0]:
            assert after.parent_hash == before.block_hashes[-1]
    assert all(index.apply(b) for b in batches)
    assert index.apply(batch("a", 6))  # the next write empties the rest of the clear's grave
    assert index.match(chain) == {"a": 2000}
    assert index.match([1]) == {"a": 0}  # cleared in the middle of the events
    index.close()
    too_many = (BlockStored(tuple(range(1, MAX_BATCH_OPS)), None, 16), AllBlocksCleared(),
                BlockRemoved((5,)))
    with pytest.raises(ValueError, match="^events: 4097"):
        KVEventBatch("a", 8, too_many)
    with pytest.raises(ValueError, match="^events: 4097"):
        KVEventBatch.from_dict({"instance_id": "a", "seq": 8,
                                "events": [event_to_dict(e) for e in too_many]})
    fits = batch_to_proto(KVEventBatch("a", 8, too_many[:2]))
    fits.events.append(router_pb2.KVEvent(removed=router_pb2.BlockRemoved(block_hashes=[5])))
    with pytest.raises(ValueError, match="^events: 4097"):
        batch_from_proto(fits)
