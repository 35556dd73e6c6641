"""Prefill and decode services in separate processes, over each KV connector."""

import grpc
import pytest
from cluster_procs import prefill_and_decode, wait_for
from connectors import ALL, connectors

from pdserve import LLM, SamplingParams
from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc

PROMPT_IDS = list(range(1000, 1090))  # 90 tokens: 5 full blocks and a partial one
GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=connectors(*ALL))
def pd(request, pd_pair):
    prefill, decode = pd_pair(request.param)
    p = engine_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill.address))
    d = engine_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    return p, d, prefill, decode


@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20)
    return lambda ids, n: llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def prefill_decode(p, d, rid, ids, sampling=GREEDY):
    first = p.Prefill(engine_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids,
                                                sampling=sampling), timeout=30)
    tokens = []
    for msg in d.Decode(engine_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, sampling=sampling, handle=first.handle,
            output_token_ids=[first.first_token_id]), timeout=30):
        tokens += msg.token_ids
    return first, tokens


def load(stub):
    return stub.GetLoad(common_pb2.LoadRequest(), timeout=5)


def all_free(stub):
    lo = load(stub)
    return lo.free_blocks == lo.total_blocks and lo.leased_requests == 0


def test_disaggregated_equals_colocated_and_releases(pd, colocated):
    p, d, _, _ = pd
    first, tokens = prefill_decode(p, d, "eq", PROMPT_IDS)
    assert first.handle.connector == load(p).connector
    assert tokens == colocated(PROMPT_IDS, 8)
    assert tokens[0] == first.first_token_id
    assert wait_for(lambda: all_free(p)) and wait_for(lambda: all_free(d))


def test_decode_pulls_only_blocks_it_lacks(pd):
    p, d, _, _ = pd
    ids = list(range(2000, 2090))
    before = load(d).kv_bytes_received
    _, _ = prefill_decode(p, d, "full", ids)
    full = load(d).kv_bytes_received - before
    assert full > 0
    # Same 5-block prefix, new tail: the decode side has the first 5 blocks cached now.
    tail = ids[:80] + list(range(3000, 3020))
    before = load(d).kv_bytes_received
    _, _ = prefill_decode(p, d, "tail", tail)
    partial = load(d).kv_bytes_received - before
    block_bytes = full // 6
    assert partial == 2 * block_bytes  # blocks 5 (full) and 6 (partial) of 100 tokens
    assert wait_for(lambda: all_free(p))


def test_unreleased_lease_expires(pd):
    p, _, _, _ = pd
    p.Prefill(engine_pb2.PrefillRequest(request_id="orphan", prompt_token_ids=PROMPT_IDS,
                                        sampling=GREEDY), timeout=30)
    assert load(p).leased_requests == 1
    assert wait_for(lambda: all_free(p), timeout=15)


def test_cancel_mid_stream_frees_decode_blocks(pd):
    p, d, _, _ = pd
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    call = d.Decode(engine_pb2.DecodeRequest(request_id="cancel", prompt_token_ids=PROMPT_IDS,
                                             sampling=sampling), timeout=60)
    next(call)
    next(call)
    call.cancel()
    assert wait_for(lambda: all_free(d))


def test_an_aborted_decode_ends_its_stream_at_once(pd):
    """Abort (a cluster member's call) ends the request's stream with ABORTED instead of
    leaving its client waiting until its deadline."""
    p, d, _, _ = pd
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    call = d.Decode(engine_pb2.DecodeRequest(request_id="aborted", prompt_token_ids=PROMPT_IDS,
                                             sampling=sampling), timeout=30)
    next(call)
    assert d.Abort(common_pb2.AbortRequest(request_id="aborted"), timeout=5).found
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.ABORTED, e.value.details()
    assert wait_for(lambda: all_free(d))


@pytest.mark.parametrize("sampling, field", [
    (common_pb2.SamplingParams(temperature=-1), "temperature"),
    (common_pb2.SamplingParams(top_p=2.0), "top_p"),
    (common_pb2.SamplingParams(max_tokens=0), "max_tokens"),
    (common_pb2.SamplingParams(n=2), "n"),
    # float32 on the wire: 1e-300 arrives as 0, 1e39 as inf (either poisoned the logits)
    (common_pb2.SamplingParams(repetition_penalty=1e-300), "repetition_penalty"),
    (common_pb2.SamplingParams(logit_bias={5: 1e39}), "logit_bias"),
])
def test_invalid_prefill_arguments(pd, sampling, field):
    p, _, _, _ = pd
    with pytest.raises(grpc.RpcError) as e:
        p.Prefill(engine_pb2.PrefillRequest(prompt_token_ids=PROMPT_IDS, sampling=sampling),
                  timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    rid = f"after-{field}"  # the instance still serves (a prompt no other test caches)
    ok = p.Prefill(engine_pb2.PrefillRequest(request_id=rid, prompt_token_ids=list(
        range(3000, 3040)), sampling=GREEDY), timeout=30)
    assert ok.handle.num_tokens > 0
    p.Release(engine_pb2.ReleaseRequest(request_id=rid), timeout=10)


def test_invalid_decode_arguments(pd):
    _, d, _, _ = pd
    bad = [
        (engine_pb2.DecodeRequest(sampling=GREEDY), "prompt_token_ids"),
        (engine_pb2.DecodeRequest(prompt_token_ids=[10**7], sampling=GREEDY), "prompt_token_ids"),
        (engine_pb2.DecodeRequest(prompt_token_ids=[1, 2], sampling=GREEDY,
                                  handle=common_pb2.KVHandle(connector="shm",
                                                             descriptor_json="{")), "handle"),
        (engine_pb2.DecodeRequest(prompt_token_ids=[1, 2], sampling=GREEDY,
                                  handle=common_pb2.KVHandle(
                                      connector="shm", descriptor_json='{"kind": "shm"}',
                                      release_address="prefill 0\n:50061")),
         "handle.release_address"),  # the decode side dials it, and logs it
    ]
    # Output tokens given as already sampled that the constraint refuses (token 1000 is "()"):
    # the caller's error, not a failed instance.
    digits = common_pb2.SamplingParams(max_tokens=4, structured_outputs=common_pb2.
                                       StructuredOutputs(regex="[0-9]+"))
    bad.append((engine_pb2.DecodeRequest(prompt_token_ids=PROMPT_IDS, sampling=digits,
                                         output_token_ids=[PROMPT_IDS[0]]), "output_token_ids"))
    for request, field in bad:
        with pytest.raises(grpc.RpcError) as e:
            list(d.Decode(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert field in e.value.details()


def test_dead_prefill_instance_decode_recomputes(tiny_model_dir, colocated):
    prefill, decode = prefill_and_decode(tiny_model_dir, "tcp")
    try:
        p = engine_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill.address))
        d = engine_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
        first = p.Prefill(engine_pb2.PrefillRequest(request_id="dead", prompt_token_ids=PROMPT_IDS,
                                                    sampling=GREEDY), timeout=30)
        prefill.kill()
        tokens = []
        for msg in d.Decode(engine_pb2.DecodeRequest(
                request_id="dead", prompt_token_ids=PROMPT_IDS, sampling=GREEDY,
                handle=first.handle, output_token_ids=[first.first_token_id]), timeout=60):
            tokens += msg.token_ids
        assert tokens == colocated(PROMPT_IDS, 8)
        lo = load(d)
        assert lo.kv_loads_failed == 1 and lo.free_blocks == lo.total_blocks
    finally:
        prefill.stop()
        decode.stop()
