"""A colocated engine and a 1P1D cluster (router, prefill and decode processes) on one GPU:
the disaggregated greedy output is token-identical to the colocated one."""

from __future__ import annotations

import grpc
import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster, ClusterSpec
from pdserve.kv_transfer import nixl_available
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

KV_BYTES = 256 << 20
THRESHOLD = 8  # every prompt below is longer: all are disaggregated
PROMPTS = [
    "The history of the printing press begins in ancient China, where woodblocks were " * 3,
    "Explain, step by step, how a refrigerator keeps food cold.",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "List five prime numbers and explain why each one is prime:",
]
CONNECTORS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="nixl is not installed"))]


# float32, so that token identity does not hinge on 16-bit rounding of matrix products whose
# algorithms may differ between processes.
@pytest.mark.parametrize("dtype", ["float32"])
@pytest.mark.parametrize("connector", CONNECTORS)
def test_1p1d_on_one_gpu_matches_colocated(tmp_path, connector, dtype):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(dtype=dtype, kv_cache_memory_bytes=KV_BYTES)
    # One request at a time on both sides, so the two see the same matrix shapes.
    want = [llm.generate(p, params, use_tqdm=False)[0] for p in PROMPTS]
    del llm
    spec = ClusterSpec(connector=connector, grpc_port=0, disagg_threshold=THRESHOLD,
                       kv_cache_memory_bytes=KV_BYTES, instance_args=("--dtype", dtype),
                       startup_timeout_s=300, log_dir=str(tmp_path))
    with Cluster(spec) as cluster:  # starts it, and stops it at the end
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
        for prompt, expected in zip(PROMPTS, want):
            request = router_pb2.GenerateRequest(text=prompt, sampling=common_pb2.SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True))
            msgs = list(stub.Generate(request, timeout=120))
            assert list(msgs[0].prompt_token_ids) == expected.prompt_token_ids
            assert [t for m in msgs for t in m.token_ids] == expected.outputs[0].token_ids
            assert msgs[-1].served_by.disaggregated, cluster.describe()
            assert msgs[-1].served_by.prefill_instance == "prefill-0"
