"""The Redis prefix index when its keys hold what it did not write (a foreign writer under its
prefix, a value that is not UTF-8, a key of another type): routing goes on for every other
block and instance, the next write repairs what it owns, and no error looks like an outage."""

from __future__ import annotations

import uuid

import pytest
import redis
from redis_fixture import RedisServer, redis_server  # noqa: F401  (session fixture)

from pdserve.engine.block_pool import BlockStored
from pdserve.router.kv_events import KVEventBatch
from pdserve.router.redis_index import RedisPrefixIndex, redacted


def stored(*hashes: int) -> BlockStored:
    return BlockStored(tuple(hashes), None, 16 * len(hashes))


def batch(iid: str, seq: int, *events) -> KVEventBatch:
    return KVEventBatch(iid, seq, tuple(events), timestamp=1.0)


@pytest.fixture
def setup(redis_server: RedisServer):  # noqa: F811
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    index = RedisPrefixIndex(redis_server.url, key_prefix=prefix, retry_interval_s=0.2)
    raw = redis.Redis.from_url(redis_server.url)
    for iid in ("a", "b"):
        assert index.heartbeat(iid, {"role": "decode", "address": f"{iid}:1"})
    assert index.apply(batch("a", 0, stored(1, 2, 3)))
    assert index.apply(batch("b", 0, stored(1, 2)))
    yield prefix, index, raw
    index.close()
    raw.close()


def test_foreign_values_are_misses_not_failures(setup):
    prefix, index, raw = setup
    raw.hset(f"{prefix}:blk:2", b"\xff\xfe", b"x")  # a field that is not UTF-8
    raw.set(f"{prefix}:blk:3", "not a hash")  # a key of another type
    raw.zadd(f"{prefix}:instances", {b"\xff\xfe": 2**50})  # an instance id that is not UTF-8
    raw.set(b"%s:inst:\xff\xfe" % prefix.encode(), b"\xff")
    assert index.match([1, 2, 3]) == {"a": 2, "b": 2}
    assert index.match([4]) == {"a": 0, "b": 0}
    assert set(index.instances()) >= {"a", "b"}
    raw.set(f"{prefix}:inst:b", "{not json")
    assert "b" not in index.instances() and "a" in index.instances()
    assert index.errors == 0 and not index._down
    assert index.apply(batch("a", 1, stored(3)))  # the foreign block key is replaced
    assert raw.type(f"{prefix}:blk:3") == b"hash"
    assert index.match([1, 2, 3]) == {"a": 3, "b": 2}


@pytest.mark.parametrize("key, value", [("nblocks", "garbage"), ("seq:a", "garbage")])
def test_a_malformed_counter_or_seq_is_repaired(setup, key, value):
    prefix, index, raw = setup
    raw.set(f"{prefix}:{key}", value)
    applied = index.apply(batch("a", 1, stored(4)))
    if key == "seq:a":  # an unknown seq: refused, and the snapshot that follows repairs it
        assert not applied and index.resync("a", [1, 2, 3, 4], seq=1)
    else:
        assert applied
    assert index.apply(batch("a", 2, stored(5)))
    assert index.match([1, 2, 3, 4, 5]) == {"a": 5, "b": 2}
    assert int(raw.get(f"{prefix}:nblocks")) == 5 + 2
    assert index.errors == 0


@pytest.mark.parametrize("key", ["instances", "nblocks", "iblk:a", "seq:a"])
def test_a_key_of_another_type_is_replaced_by_the_next_write(setup, key):
    prefix, index, raw = setup
    raw.delete(f"{prefix}:{key}")
    raw.hset(f"{prefix}:{key}", "x", "y")
    assert index.heartbeat("a", {"role": "decode"}) and index.heartbeat("b", {"role": "decode"})
    if not index.apply(batch("a", 1, stored(4))):  # its seq or its blocks were lost
        assert index.resync("a", [1, 2, 3, 4], seq=1)
    assert index.apply(batch("a", 2, stored(5)))
    assert index.match([1, 2, 3, 4, 5])["a"] == 5
    assert not index._down


def test_the_redis_password_stays_out_of_logs():
    assert redacted("redis://reader:s3cret@db:6379/0") == "redis://reader:***@db:6379/0"
    assert redacted("redis://:s3cret@db:6379") == "redis://:***@db:6379"
    assert redacted("redis://db:6379/0") == "redis://db:6379/0"
    index = RedisPrefixIndex("redis://u:s3cret@127.0.0.1:1/0")
    assert "s3cret" not in index.where
    index.close()
