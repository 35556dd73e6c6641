"""A slow prefill is not a dead instance: the router waits for it while it answers its
liveness probe, instead of marking it down and prefilling elsewhere. The same holds for an
embedding; a frozen instance (no probe answer) is marked down and the embedding moves."""

import os
import signal

import grpc
import pytest
import torch
from frozen import freeze

from pdserve import LLM, PoolingParams, SamplingParams
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


def test_embedding_is_waited_for_while_slow_and_moved_when_frozen(cluster, tiny_model_dir):
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=8)
    fresh = [200 + (i * 11) % 5000 for i in range(1900)]  # not in any prefix cache
    slow_ids, moved_ids = fresh[:1800], fresh[1800:]
    want = [llm.embed({"prompt_token_ids": ids}, PoolingParams(), use_tqdm=False)[0]
            for ids in (slow_ids, moved_ids)]
    # Slow (450 steps of 4 tokens, several probe intervals even on a fast machine), answering
    # its probe: waited for on the prefill instance.
    slow = stub.Embed(router_pb2.EmbedRequest(token_ids=router_pb2.TokenIds(ids=slow_ids)),
                      timeout=300)
    assert slow.instance_id == "prefill-0"
    # Frozen: its probe goes unanswered, so the decode instance computes the embedding.
    prefill = cluster.child("prefill-0").proc
    freeze(prefill.pid)
    try:
        moved = stub.Embed(router_pb2.EmbedRequest(
            token_ids=router_pb2.TokenIds(ids=moved_ids)), timeout=120)
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    assert moved.instance_id == "decode-0"
    # NOTE: 5e-4, not 1e-4: about one process in ten computes this tiny model's 1,800-token
    # embedding 1.3e-4 away from transformers' (the others within 1e-6), whatever its hash
    # seed, on both the native and the module path. Its head size (16) sends attention to
    # torch's SDPA, whose MKL calls have the same shapes, alignments and thread counts either
    # way (MKL_VERBOSE); MKL_CBWR=COMPATIBLE gave one value in 20 processes. Not explained yet.
    for got, w in zip((slow, moved), want, strict=True):
        assert torch.allclose(torch.tensor(list(got.embedding)),
                              torch.tensor(w.outputs.embedding), atol=5e-4)
    router_log = (cluster.log_dir / "router.log").read_text()
    assert "embedding on prefill-0 still running" in router_log  # it outlasted a probe
    assert "embedding on prefill-0 failed: it stopped answering" in router_log
