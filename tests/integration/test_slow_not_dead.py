"""A slow prefill is not a dead instance: the router waits for it while it answers its
liveness probe, instead of marking it down and prefilling elsewhere."""

import grpc
import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster, ClusterSpec
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

CHUNK = ("--max-num-batched-tokens", "4")  # a long prompt takes hundreds of steps
PROMPT = [100 + (i * 7) % 5000 for i in range(1900)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model=str(tiny_model_dir), connector="shm", grpc_port=0,
                       disagg_threshold=16, kv_cache_memory_bytes=16 << 20,
                       startup_timeout_s=90, instance_args=CHUNK,
                       router_args=("--prefill-timeout-s", "0.05"),
                       log_dir=str(tmp_path_factory.mktemp("slow")))
    with Cluster(spec) as c:
        yield c


def test_prefill_longer_than_the_probe_interval_is_waited_for(cluster, tiny_model_dir):
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=PROMPT),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    msgs = list(stub.Generate(request, timeout=300))
    served = msgs[-1].served_by
    assert served.disaggregated and served.prefill_instance == "prefill-0", served
    router_log = (cluster.log_dir / "router.log").read_text()
    assert "still running" in router_log  # the prefill outlasted a probe interval
    assert "stopped answering" not in router_log
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=8)
    want = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert [t for m in msgs for t in m.token_ids] == want
