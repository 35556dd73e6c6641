"""Prefix-aware routing end to end: two prefill instances, KV events, in-memory and Redis."""

import itertools

import grpc
from cluster_procs import wait_for
from redis_fixture import RedisServer, _find_or_install_redis_server

from pdserve.cluster import Cluster, ClusterSpec
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

PREFIX_TOKENS = 64  # 4 full blocks


def prompt(prefix: int, suffix: int) -> list[int]:
    return [1000 + 97 * prefix + i for i in range(PREFIX_TOKENS)] + \
        [30000 + 31 * suffix + i for i in range(20)]


def generate(stub, ids):
    """Run one request; returns (tokens, prefill instance, cached tokens, prefill attempts)."""
    tokens, last = [], None
    for msg in stub.Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
            timeout=60):
        tokens += msg.token_ids
        last = msg
    return tokens, last.served_by.prefill_instance, last.usage.cached_tokens, \
        last.served_by.prefill_attempts


BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny model's KV per block (2 layers, 2 kv heads)


def start(model_dir, logs, redis_url=None, num_blocks=1024):
    spec = ClusterSpec(model=str(model_dir), num_prefill=2, num_decode=1, grpc_port=0,
                       disagg_threshold=0, kv_cache_memory_bytes=num_blocks * BLOCK_BYTES,
                       redis_url=redis_url,
                       startup_timeout_s=120, log_dir=str(logs))
    cluster = Cluster(spec).start()
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    return cluster, stub


def indexed_blocks(stub) -> dict[str, int]:
    return {i.instance_id: i.indexed_blocks for i in prefill_loads(stub)}


def lands_on_holder(stub, prefix: int) -> tuple[bool, str]:
    """A second prompt sharing `prefix` goes to the prefill instance that computed it, once
    the router's index has that instance's blocks (KV events come every 0.1 s, later on a
    loaded machine)."""
    before = indexed_blocks(stub)
    _, first, _, _ = generate(stub, prompt(prefix, 1))
    wait_for(lambda: indexed_blocks(stub).get(first, 0)
             >= before.get(first, 0) + PREFIX_TOKENS // 16, timeout=20)
    _, second, cached, _ = generate(stub, prompt(prefix, 2))
    return second == first and cached >= PREFIX_TOKENS, first


def prefill_loads(stub):
    listed = stub.ListInstances(router_pb2.ListInstancesRequest(), timeout=5)
    return [i for i in listed.instances if i.role == "prefill"]


def index_matches_engines(stub) -> bool:
    return all(i.indexed_blocks == i.cached_blocks for i in prefill_loads(stub))


def test_memory_index_routes_to_prefix_holder_and_skips_dead(tiny_model_dir, tmp_path):
    cluster, stub = start(tiny_model_dir, tmp_path, num_blocks=24)
    try:
        holders = set()
        for prefix in range(4):
            ok, holder = lands_on_holder(stub, prefix)
            assert ok, f"prefix {prefix} did not follow its cache"
            holders.add(holder)
        assert len(holders) == 2, "load spreads new prefixes over both instances"
        # Overfill both 24-block caches: evictions must leave the index equal to the engines.
        for other in range(100, 110):
            generate(stub, prompt(other, 0))
        assert wait_for(lambda: index_matches_engines(stub), timeout=10)
        assert all(0 < i.cached_blocks <= 24 for i in prefill_loads(stub))
        assert sum(i.cached_blocks for i in prefill_loads(stub)) < 4 * 7 + 10 * 6  # evicted
        # Kill the holder of prefix 0: once the router stops listing it, it gets no traffic.
        _, holder, _, _ = generate(stub, prompt(0, 3))
        cluster.child(holder).proc.kill()  # instance ids are the children's names
        assert wait_for(lambda: holder not in {i.instance_id for i in prefill_loads(stub)})
        for suffix in range(4, 7):
            tokens, served, _, attempts = generate(stub, prompt(0, suffix))
            assert served != holder and attempts == 1 and len(tokens) == 4
    finally:
        cluster.stop()


def test_redis_index_survives_an_outage(tiny_model_dir, tmp_path):
    redis = RedisServer(_find_or_install_redis_server(), tmp_path)
    redis.start()
    cluster, stub = start(tiny_model_dir, tmp_path / "logs", redis.url)
    try:
        assert wait_for(lambda: lands_on_holder(stub, 10)[0], timeout=20)
        redis.stop()
        for suffix in range(3):  # routing by load alone: still served
            tokens, _, _, _ = generate(stub, prompt(11, suffix))
            assert len(tokens) == 4
        errors = stub.ListInstances(router_pb2.ListInstancesRequest(), timeout=5)
        assert errors.prefix_index_errors > 0  # the outage shows in the metric
        redis.start()  # empty: instances resync their state into it
        fresh = itertools.count(12)  # a new prefix each try
        assert wait_for(lambda: lands_on_holder(stub, next(fresh))[0], timeout=30, interval=1)
    finally:
        cluster.stop()
        redis.stop()
