"""The router's load rule (`--disagg-min-running`) with real router, prefill and decode
processes: a prompt long enough to disaggregate goes through the prefill instance only while
the decode instance already runs that many requests."""

import grpc
import pytest
from cluster_procs import wait_for

from pdserve.cluster import Cluster, ClusterSpec
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

MIN_RUNNING = 2


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model=str(tiny_model_dir), grpc_port=0, disagg_threshold=16,
                       disagg_min_running=MIN_RUNNING, kv_cache_memory_bytes=8 << 20,
                       startup_timeout_s=90, log_dir=str(tmp_path_factory.mktemp("logs")))
    with Cluster(spec) as running:
        yield running


def router(cluster):
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))


def open_stream(cluster, first_id: int):
    """A 40-token prompt decoding 1,500 tokens: the call and its first message."""
    call = router(cluster).Generate(router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=list(range(first_id, first_id + 40))),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)),
        timeout=60)
    return call, next(call)


def decode_running(cluster) -> int:
    listed = router(cluster).ListInstances(router_pb2.ListInstancesRequest(), timeout=5)
    loads = {i.instance_id: i for i in listed.instances}
    return loads["decode-0"].running_requests + loads["decode-0"].waiting_requests


def test_prompts_go_through_prefill_only_while_decode_is_busy(cluster):
    calls = []
    try:
        # Two streams open: the first two prompts found fewer than MIN_RUNNING on D, the
        # third found two.
        for i, disaggregated in enumerate([False, False, True]):
            call, first = open_stream(cluster, 5000 + 100 * i)
            calls.append(call)
            assert first.served_by.disaggregated is disaggregated, i
            assert first.token_ids
    finally:
        for call in calls:
            call.cancel()
    # Once the streams are gone (the router's own count with them, and D's next report), a
    # prompt stays on D again.
    assert wait_for(lambda: decode_running(cluster) == 0, timeout=15)
    call, first = open_stream(cluster, 5400)
    call.cancel()
    assert not first.served_by.disaggregated
