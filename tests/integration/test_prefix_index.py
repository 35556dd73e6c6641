"""Contract tests for the prefix index, run against both backends (memory, real redis-server)."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from redis_fixture import RedisServer, redis_server  # noqa: F401  (session fixture)

from pdserve.engine.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored
from pdserve.router.kv_events import KVEventBatch, KVEventSequencer
from pdserve.router.memory_index import MemoryPrefixIndex
from pdserve.router.prefix_index import PrefixIndex

MakeIndex = Callable[..., PrefixIndex]


@pytest.fixture(params=["memory", "redis"])
def make_index(request: pytest.FixtureRequest) -> Iterator[MakeIndex]:
    """Factory of index objects; within one test, Redis ones share a fresh key prefix."""
    made: list[PrefixIndex] = []
    if request.param == "memory":
        def make(ttl_s: float = 30.0, **caps: int) -> PrefixIndex:
            made.append(MemoryPrefixIndex(ttl_s=ttl_s, **caps))
            return made[-1]
    else:
        server: RedisServer = request.getfixturevalue("redis_server")  # may skip
        from pdserve.router.redis_index import RedisPrefixIndex

        prefix = f"test-{uuid.uuid4().hex[:8]}"

        def make(ttl_s: float = 30.0, **caps: int) -> PrefixIndex:
            made.append(RedisPrefixIndex(server.url, key_prefix=prefix, ttl_s=ttl_s,
                                         retry_interval_s=0.2, **caps))
            return made[-1]
    yield make
    for index in made:
        index.close()


def stored(*hashes: int) -> BlockStored:
    return BlockStored(tuple(hashes), None, 16 * len(hashes))


def batch(iid: str, seq: int, *events) -> KVEventBatch:
    return KVEventBatch(iid, seq, tuple(events), timestamp=1.0)


def live(index: PrefixIndex, *iids: str) -> None:
    for iid in iids:
        index.heartbeat(iid, {"role": "prefill", "address": f"{iid}:9000"})


def test_match_longest_prefix_across_instances(make_index: MakeIndex) -> None:
    index = make_index()
    live(index, "a", "b", "c")
    assert index.apply(batch("a", 0, stored(1, 2, 3, 4)))
    assert index.apply(batch("b", 0, stored(1, 2), stored(9)))
    assert index.apply(batch("c", 0, stored(2, 3, 4)))  # no first block: matches nothing
    assert index.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2, "c": 0}
    assert index.match([1, 2, 9]) == {"a": 2, "b": 3, "c": 0}
    assert index.match([1, 5, 2, 3]) == {"a": 1, "b": 1, "c": 0}  # stops at the first miss
    assert index.match([7, 1]) == {"a": 0, "b": 0, "c": 0}
    assert index.match([]) == {"a": 0, "b": 0, "c": 0}
    assert index.num_blocks("a") == 4 and index.num_blocks("b") == 3


def test_removal_and_all_cleared(make_index: MakeIndex) -> None:
    index = make_index()
    live(index, "a", "b")
    assert index.apply(batch("a", 0, stored(1, 2, 3)))
    assert index.apply(batch("b", 0, stored(1, 2, 3)))
    assert index.apply(batch("a", 1, BlockRemoved((3,))))
    assert index.match([1, 2, 3]) == {"a": 2, "b": 3}
    assert index.apply(batch("b", 1, BlockRemoved((1,))))  # the prefix is broken at block 0
    assert index.match([1, 2, 3]) == {"a": 2, "b": 0}
    assert index.apply(batch("a", 2, AllBlocksCleared(), stored(1)))  # events apply in order
    assert index.match([1, 2, 3]) == {"a": 1, "b": 0}
    assert index.num_blocks("a") == 1


def test_seq_gap_backwards_and_resync(make_index: MakeIndex) -> None:
    index = make_index()
    live(index, "a")
    assert not index.apply(batch("a", 3, stored(1)))  # seq unknown: resync first
    assert index.match([1]) == {"a": 0}
    assert index.apply(batch("a", 0, stored(1)))
    assert index.apply(batch("a", 0, stored(1)))  # duplicate delivery is a no-op
    assert not index.apply(batch("a", 2, stored(2)))  # gap: seq 1 was lost
    assert index.match([1, 2]) == {"a": 1}  # nothing of the refused batch applied
    assert index.resync("a", [1, 2, 5], seq=2)
    assert index.match([1, 2, 5]) == {"a": 3}
    assert index.apply(batch("a", 3, BlockRemoved((5,))))
    assert not index.apply(batch("a", 1, stored(7)))  # went backwards
    assert index.apply(batch("a", 0, stored(8)))  # restart: a fresh instance, old blocks gone
    assert index.match([1]) == {"a": 0} and index.match([8]) == {"a": 1}


def test_events_travel_as_json(make_index: MakeIndex) -> None:
    index = make_index()
    live(index, "a")
    sent = KVEventBatch("a", 0, (stored(11, 12), BlockRemoved((12,)), stored(13)),
                        timestamp=5.5, medium="cpu")
    received = KVEventBatch.from_dict(json.loads(json.dumps(sent.to_dict())))
    assert received == sent
    assert index.apply(received)
    assert index.match([11, 13]) == {"a": 2}
    with pytest.raises(ValueError, match="events.type"):
        KVEventBatch.from_dict({"instance_id": "a", "seq": 1, "events": [{"type": "x"}]})


def test_block_pool_events_agree_with_pool_lookup(make_index: MakeIndex) -> None:
    index = make_index()
    live(index, "p")
    pool = BlockPool(num_blocks=4, record_events=True)
    seq = KVEventSequencer("p")
    blocks = pool.allocate(3)
    pool.cache(blocks, [101, 102, 103], None, block_size=16)
    pool.release(blocks[::-1])
    assert index.apply(seq.batch(pool.take_events()))
    assert index.match([101, 102, 103, 104]) == {"p": 3}
    pool.allocate(3)  # the unused block, then the least recently freed: 103, 102
    assert index.apply(seq.batch(pool.take_events()))
    assert index.match([101, 102, 103]) == {"p": len(pool.lookup([101, 102, 103]))} == {"p": 1}


def test_lapsed_heartbeat_stops_counting_at_once_and_is_cleaned(make_index: MakeIndex) -> None:
    index = make_index(ttl_s=1.0)
    live(index, "a", "b")
    assert index.apply(batch("a", 0, stored(1, 2)))
    assert index.apply(batch("b", 0, stored(1, 2)))
    assert set(index.instances()) == {"a", "b"}
    assert index.instances()["a"] == {"role": "prefill", "address": "a:9000"}
    time.sleep(0.6)
    live(index, "a")
    time.sleep(0.6)  # b's heartbeat is now 1.2 s old, a's 0.6 s
    assert index.match([1, 2]) == {"a": 2}  # before any sweep
    assert set(index.instances()) == {"a"}
    assert index.sweep() == 1
    assert index.num_blocks("b") == 0 and index.num_blocks("a") == 2
    live(index, "b")  # b comes back: it starts from nothing and must resync
    assert index.match([1, 2]) == {"a": 2, "b": 0}
    assert not index.apply(batch("b", 1, stored(3)))


def test_events_before_first_heartbeat_count_once_it_arrives(make_index: MakeIndex) -> None:
    index = make_index()
    assert index.apply(batch("a", 0, stored(1)))
    assert index.match([1]) == {}
    live(index, "a")
    assert index.match([1]) == {"a": 1}


def test_remove_instance(make_index: MakeIndex) -> None:
    index = make_index()
    live(index, "a", "b")
    assert index.apply(batch("a", 0, stored(1)))
    index.remove_instance("a")
    assert index.match([1]) == {"b": 0}
    assert set(index.instances()) == {"b"} and index.num_blocks("a") == 0
    assert not index.apply(batch("a", 1, stored(2)))
    live(index, "c")  # a newcomer inherits nothing from the removed instance
    assert index.match([1]) == {"b": 0, "c": 0}


def test_an_instance_is_credited_with_at_most_max_blocks(make_index: MakeIndex) -> None:
    index = make_index(max_blocks_per_instance=4)
    live(index, "a", "b")
    assert index.apply(batch("a", 0, stored(1, 2, 3, 4, 5, 6)))
    assert index.num_blocks("a") == 4 and index.capped == 2
    assert index.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 0}
    assert index.apply(batch("a", 1, stored(1, 2), BlockRemoved((4,)), stored(5, 6)))
    assert index.num_blocks("a") == 4 and index.capped == 3  # 1, 2 held; 5 took 4's place
    assert index.match([1, 2, 3, 5]) == {"a": 4, "b": 0}
    assert index.apply(batch("b", 0, stored(1, 2, 3, 4, 5)))  # the cap is per instance
    assert index.match([1, 2, 3, 4]) == {"a": 3, "b": 4}
    assert index.resync("b", list(range(100, 110)), seq=0)
    assert index.num_blocks("b") == 4 and index.capped == 10
    assert index.match([100, 101, 102, 103, 104]) == {"a": 0, "b": 4}


def test_all_instances_together_hold_at_most_max_blocks(make_index: MakeIndex) -> None:
    index = make_index(max_blocks=5)
    live(index, "a", "b")
    assert index.apply(batch("a", 0, stored(1, 2, 3, 4)))
    assert index.apply(batch("b", 0, stored(1, 2, 3)))
    assert index.num_blocks("b") == 1 and index.capped == 2
    assert index.apply(batch("a", 1, BlockRemoved((3, 4))))  # frees room for b
    assert index.apply(batch("b", 1, stored(2, 3, 4)))
    assert index.match([1, 2, 3, 4]) == {"a": 2, "b": 3} and index.capped == 3
    index.remove_instance("b")
    assert index.resync("a", [1, 2, 3, 4, 5, 6], seq=1)
    assert index.num_blocks("a") == 5 and index.capped == 4


def test_instances_beyond_max_instances_are_refused_until_one_lapses(
        make_index: MakeIndex) -> None:
    index = make_index(ttl_s=1.0, max_instances=2)
    live(index, "a", "b")
    assert not index.heartbeat("c", {"role": "decode", "address": "c:9000"})
    assert set(index.instances()) == {"a", "b"}
    assert not index.apply(batch("c", 0, stored(1)))
    assert not index.resync("c", [1], seq=-1)
    assert index.num_blocks("c") == 0 and index.capped == 3
    assert index.apply(batch("a", 0, stored(1)))  # those it knows go on as before
    live(index, "a")
    assert index.match([1]) == {"a": 1, "b": 0}
    time.sleep(1.2)  # a and b lapse: their places are free
    live(index, "c")
    assert index.apply(batch("c", 0, stored(1)))
    assert index.match([1]) == {"c": 1}


def test_random_event_streams_match_a_reference_model(make_index: MakeIndex) -> None:
    rng = random.Random(7)
    index = make_index()
    held: dict[str, set[int]] = {i: set() for i in "abc"}
    seqs = dict.fromkeys(held, 0)
    live(index, *held)
    for i in held:
        assert index.apply(batch(i, 0))
    for _ in range(150):
        i = rng.choice("abc")
        hashes = rng.sample(range(12), rng.randint(1, 4))
        kind = rng.random()
        if kind < 0.6:
            event = stored(*hashes)
            held[i].update(hashes)
        elif kind < 0.95:
            event = BlockRemoved(tuple(hashes))
            held[i].difference_update(hashes)
        else:
            event = AllBlocksCleared()
            held[i].clear()
        seqs[i] += 1
        assert index.apply(batch(i, seqs[i], event))
        prompt = rng.sample(range(12), 5)
        want = {}
        for j, mine in held.items():
            want[j] = next((n for n, h in enumerate(prompt) if h not in mine), len(prompt))
        assert index.match(prompt) == want


# --- Redis only --------------------------------------------------------------------------


def redis_index(server: RedisServer, prefix: str, **kw):
    from pdserve.router.redis_index import RedisPrefixIndex

    return RedisPrefixIndex(server.url, key_prefix=prefix, **kw)


def test_two_routers_share_state(redis_server: RedisServer) -> None:  # noqa: F811
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    r1, r2 = redis_index(redis_server, prefix), redis_index(redis_server, prefix)
    live(r1, "a")
    live(r2, "b")
    assert r1.apply(batch("a", 0, stored(1, 2)))
    assert r2.apply(batch("b", 0, stored(1)))
    assert r2.apply(batch("a", 1, stored(3)))  # a's stream continues through another router
    assert r1.apply(batch("a", 1, stored(3)))  # the same batch again: a no-op
    assert r1.match([1, 2, 3]) == r2.match([1, 2, 3]) == {"a": 3, "b": 1}
    assert r1.instances() == r2.instances()
    r2.remove_instance("a")
    assert r1.match([1, 2, 3]) == {"b": 1}


def test_lapsed_instance_leaves_no_keys(redis_server: RedisServer) -> None:  # noqa: F811
    import redis

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    index = redis_index(redis_server, prefix, ttl_s=0.2)
    live(index, "a")
    assert index.apply(batch("a", 0, stored(1, 2, 3)))
    time.sleep(0.3)
    assert index.sweep() == 1
    assert redis.Redis.from_url(redis_server.url).keys(f"{prefix}:*") == []


def test_a_drifted_block_count_is_recounted_before_it_refuses(
        redis_server: RedisServer) -> None:  # noqa: F811
    """P:nblocks too high (an older writer's sweep, an evicted key) is counted again from
    the instances' sets instead of refusing every block for good."""
    import redis

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    index = redis_index(redis_server, prefix, max_blocks=4)
    live(index, "a")
    assert index.apply(batch("a", 0, stored(1, 2)))
    redis.Redis.from_url(redis_server.url).set(f"{prefix}:nblocks", 10**6)
    assert index.apply(batch("a", 1, stored(3, 4, 5)))
    assert index.num_blocks("a") == 4 and index.capped == 1
    assert int(redis.Redis.from_url(redis_server.url).get(f"{prefix}:nblocks")) == 4


def test_redis_outage_and_recovery(redis_server: RedisServer,  # noqa: F811
                                   caplog: pytest.LogCaptureFixture) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    index = redis_index(redis_server, prefix, retry_interval_s=0.2)
    live(index, "a")
    assert index.apply(batch("a", 0, stored(1, 2)))
    assert index.match([1, 2]) == {"a": 2}
    redis_server.stop()
    try:
        start = time.monotonic()
        assert index.match([1, 2]) == {}
        assert index.match([1, 2]) == {}  # answered from the outage flag, no new attempt
        assert index.instances() == {}
        assert not index.apply(batch("a", 1, stored(3)))
        index.heartbeat("a", {})
        assert time.monotonic() - start < 1.0
        assert index.errors >= 5
        failed = [r for r in caplog.records if "failed" in r.getMessage()]
        assert len(failed) == 1 and failed[0].levelname == "WARNING"  # once per outage
    finally:
        redis_server.start()  # same port, empty: no persistence
    time.sleep(0.25)  # past retry_interval_s
    assert index.match([1, 2]) == {}  # Redis is back but knows nothing yet
    live(index, "a")
    assert not index.apply(batch("a", 2, stored(3)))  # seq unknown after the restart
    assert index.resync("a", [1, 2, 3], seq=2)
    assert index.match([1, 2, 3]) == {"a": 3}
    assert index.apply(batch("a", 3, stored(4)))
    assert index.match([1, 2, 3, 4]) == {"a": 4}
    errors = index.errors
    assert index.match([1]) == {"a": 1} and index.errors == errors


def test_clusters_sharing_a_redis_keep_apart_by_key_prefix(
        redis_server: RedisServer) -> None:  # noqa: F811
    """Two clusters whose instances have the same ids (`pdserve up` names them decode-0, ...)
    each see their own blocks under their own --redis-key-prefix."""
    from pdserve.cli import build_parser
    from pdserve.router.prefix_index import PrefixIndexConfig, create_prefix_index

    tag = uuid.uuid4().hex[:8]
    indexes = []
    for name in ("blue", "green"):
        args = build_parser().parse_args(["decode", "--redis-url", redis_server.url,
                                          "--redis-key-prefix", f"{name}-{tag}"])
        indexes.append(create_prefix_index(PrefixIndexConfig(
            "redis", args.redis_url, args.redis_key_prefix)))
    blue, green = indexes
    live(blue, "decode-0")
    live(green, "decode-0")
    assert blue.apply(batch("decode-0", 0, stored(1, 2)))
    assert green.apply(batch("decode-0", 0, stored(7)))
    assert blue.match([1, 2]) == {"decode-0": 2} and green.match([1, 2]) == {"decode-0": 0}
    assert green.match([7]) == {"decode-0": 1} and blue.match([7]) == {"decode-0": 0}
    with pytest.raises(ValueError, match="redis_key_prefix"):
        PrefixIndexConfig("redis", redis_server.url, "two words")
    for index in indexes:
        index.close()


def test_matches_go_on_while_writes_are_paused(redis_server: RedisServer) -> None:  # noqa: F811
    """A failover pauses writes (CLIENT PAUSE WRITE): the read-only listing of live
    instances is flagged so, and matches still answer."""
    import redis

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    index = redis_index(redis_server, prefix)
    live(index, "a")
    assert index.apply(batch("a", 0, stored(1, 2)))
    raw = redis.Redis.from_url(redis_server.url)
    raw.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
    try:
        assert index.match([1, 2]) == {"a": 2}
        assert set(index.instances()) == {"a"}
    finally:
        raw.execute_command("CLIENT", "UNPAUSE")
        raw.close()
        index.close()
