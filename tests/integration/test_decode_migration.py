"""A decode instance killed mid-stream: the request migrates to another decode instance and
the client sees one uninterrupted stream, token-identical (greedy) to an undisturbed run.
Three decode instances: each migration test kills one."""

import re
import signal

import grpc
import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster, ClusterSpec
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

PROMPT = list(range(5000, 5040))
NEW_TOKENS = 400


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model=str(tiny_model_dir), connector="tcp", num_prefill=1, num_decode=3,
                       grpc_port=0, disagg_threshold=16, kv_cache_memory_bytes=16 << 20,
                       startup_timeout_s=90, log_dir=str(tmp_path_factory.mktemp("migrate")))
    with Cluster(spec) as c:
        yield c


def test_decode_killed_mid_stream_continues_elsewhere(cluster, tiny_model_dir):
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=PROMPT),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                           ignore_eos=True, prompt_logprobs=1))
    call = stub.Generate(request, timeout=120)
    msgs = [next(call) for _ in range(3)]
    victim = msgs[0].served_by.decode_instance
    assert victim.startswith("decode-") and msgs[0].served_by.disaggregated
    cluster.child(victim).proc.send_signal(signal.SIGKILL)
    msgs += list(call)  # no error: the stream goes on
    last = msgs[-1]
    assert last.finish_reason == "length" and last.served_by.migrations == 1
    assert last.served_by.decode_instance not in ("", victim)
    tokens = [t for m in msgs for t in m.token_ids]
    assert last.usage.completion_tokens == len(tokens) == NEW_TOKENS
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=16 << 20)
    want = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert tokens == want.token_ids
    assert "".join(m.text for m in msgs) == want.text
    # The prefill instance's prompt logprobs, once: the continuations do not recompute them.
    assert [len(m.prompt_logprobs) for m in msgs] == [len(PROMPT)] + [0] * (len(msgs) - 1)
    assert not msgs[0].prompt_logprobs[0].entries
    assert [p.entries[0].token_id for p in msgs[0].prompt_logprobs[1:]] == PROMPT[1:]


def test_no_decode_left_ends_with_a_clear_error(tiny_model_dir, tmp_path):
    spec = ClusterSpec(model=str(tiny_model_dir), connector="tcp", num_prefill=1, num_decode=1,
                       grpc_port=0, disagg_threshold=16, kv_cache_memory_bytes=16 << 20,
                       startup_timeout_s=90, log_dir=str(tmp_path))
    with Cluster(spec) as cluster:
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
        request = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=PROMPT),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1500,
                                               ignore_eos=True))
        call = stub.Generate(request, timeout=60)
        for _ in range(3):
            next(call)
        cluster.child("decode-0").proc.send_signal(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "decode-0 failed mid-stream" in e.value.details()


def test_migration_keeps_the_grammar(cluster, tiny_model_dir):
    """A constrained stream migrates: the new decode instance's matcher is advanced over the
    tokens the client has, so the output still matches and equals an undisturbed run."""
    pattern = r"([a-z]{1,3} )+"
    structured = common_pb2.StructuredOutputs(regex=pattern)
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=PROMPT[::-1]),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                           structured_outputs=structured))
    call = stub.Generate(request, timeout=120)
    msgs = [next(call) for _ in range(3)]
    victim = msgs[0].served_by.decode_instance
    cluster.child(victim).proc.send_signal(signal.SIGKILL)
    msgs += list(call)
    assert msgs[-1].served_by.migrations == 1
    tokens = [t for m in msgs for t in m.token_ids]
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=16 << 20)
    want = llm.generate({"prompt_token_ids": PROMPT[::-1]}, SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, structured_outputs={"regex": pattern}),
        use_tqdm=False)[0].outputs[0]
    assert tokens == want.token_ids
    text = "".join(m.text for m in msgs)
    assert text == want.text and re.fullmatch(r"([a-z]{1,3} )*[a-z]{0,3}", text)
