"""A full instance is not a dead one. Each server runs a bounded number of long calls (prefills,
decode streams, generations); one more is refused at once with RESOURCE_EXHAUSTED, while health
checks, load reports and heartbeats still get a thread, so the router keeps routing to the
instance, tells the extra client to retry, and leaves no KV block held."""

import itertools

import grpc
import pytest
from cluster_procs import all_free, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster, ClusterSpec
from pdserve.proto.pdserve.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

IN_FLIGHT = 2
_PROBES = itertools.count()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model=str(tiny_model_dir), connector="shm", grpc_port=0,
                       disagg_threshold=16, kv_cache_memory_bytes=16 << 20,
                       startup_timeout_s=90,
                       instance_args=("--max-requests-in-flight", str(IN_FLIGHT)),
                       router_args=("--max-requests-in-flight", str(IN_FLIGHT)),
                       log_dir=str(tmp_path_factory.mktemp("full")))
    with Cluster(spec) as c:
        yield c


def generate(router, ids, max_tokens, timeout=60):
    return router.Generate(router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens,
                                           ignore_eos=True)), timeout=timeout)


def hold(calls):
    """Wait for each stream's first message: the call is running on its server."""
    for call in calls:
        next(call)
    return calls


def has_room(decode_stub) -> bool:
    """IN_FLIGHT short decode streams run at once on the instance: none of its slots is held."""
    probe = next(_PROBES)
    calls = [decode_stub.Decode(engine_pb2.DecodeRequest(
        request_id=f"probe-{probe}-{i}", prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
        timeout=30) for i in range(IN_FLIGHT)]
    try:
        for call in calls:
            list(call)
        return True
    except grpc.RpcError:
        return False


def test_a_full_decode_refuses_one_more_and_stays_routable(cluster, tiny_model_dir):
    router = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    decode = cluster.child("decode-0").address
    d = engine_pb2_grpc.DecodeStub(grpc.insecure_channel(decode))
    # Two long decode streams, straight to the decode instance, fill its calls.
    direct = hold([d.Decode(engine_pb2.DecodeRequest(
        request_id=f"long-{i}", prompt_token_ids=list(range(3000 + 100 * i, 3040 + 100 * i)),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1900, ignore_eos=True)),
        timeout=60) for i in range(IN_FLIGHT)])
    extra = list(range(3500, 3540))
    with pytest.raises(grpc.RpcError) as e:
        list(generate(router, extra, 4))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert "decode-0" in e.value.details()
    # Full, not dead: it answers its health check and stays among the routable instances.
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(decode))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    listed = router.ListInstances(router_pb2.ListInstancesRequest(), timeout=5).instances
    assert {i.instance_id for i in listed} == {"prefill-0", "decode-0"}
    for call in direct:
        call.cancel()
    # The decode server gives a cancelled stream's slot back when it next notices the cancel:
    # wait for both, or a generation below could be refused there and free its router slot.
    assert wait_for(lambda: has_room(d), timeout=15, interval=0.2)
    # The router's own bound: two generations in flight, a third is refused by the router.
    through = hold([generate(router, list(range(3600 + 100 * i, 3640 + 100 * i)), 1900)
                    for i in range(IN_FLIGHT)])
    with pytest.raises(grpc.RpcError) as e:
        list(generate(router, extra, 4))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Router/Generate" in e.value.details()
    for call in through:
        call.cancel()
    # Room again: the refused prompt is served, right, and nothing is left held.
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=16 << 20)
    want = llm.generate({"prompt_token_ids": extra}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids

    def served():
        try:
            return [t for m in generate(router, extra, 4) for t in m.token_ids]
        except grpc.RpcError:  # a cancelled call's slot is given back a moment later
            return None

    assert wait_for(lambda: served() == want, timeout=15, interval=0.2)
    assert wait_for(lambda: all_free(cluster), timeout=15)
