"""The internal plane under attack: forged KV handles sent to a real decode process.

Each attack is refused with INVALID_ARGUMENT naming the field, or, where the handle is well
formed but points elsewhere, the load fails and the request is recomputed; nothing outside the
engine's own segments is touched, and the instance keeps serving correct answers.
"""

import json
import os

import grpc
import pytest
from connectors import ALL, connectors
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import LLM, SamplingParams
from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc

# 40 tokens: 2 full blocks and a partial one; test_services, on the same processes, uses others
PROMPT = list(range(5000, 5040))
GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=connectors(*ALL))
def pd(request, pd_pair):
    prefill, decode = pd_pair(request.param)
    p = engine_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill.address))
    d = engine_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    return p, d, decode, request.param


@pytest.fixture(scope="module")
def want(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20)
    return llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def prefill(p, rid):
    return p.Prefill(engine_pb2.PrefillRequest(request_id=rid, prompt_token_ids=PROMPT,
                                               sampling=GREEDY), timeout=30)


def decode(d, rid, handle, first_token):
    tokens = []
    for msg in d.Decode(engine_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=PROMPT, sampling=GREEDY, handle=handle,
            output_token_ids=[first_token]), timeout=30):
        tokens += msg.token_ids
    return tokens  # the stream starts with the first token too


def still_serves(p, d, decode_proc, want, rid):
    """The decode process is alive, SERVING, and answers a genuine request correctly."""
    assert decode_proc.proc.poll() is None
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(decode_proc.address))
    status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    first = prefill(p, rid)
    assert decode(d, rid, first.handle, first.first_token_id) == want


@pytest.mark.parametrize("field, forge", [
    ("handle.num_tokens", lambda h: setattr(h, "num_tokens", -5)),
    ("handle.num_tokens", lambda h: setattr(h, "num_tokens", 10**12)),
    ("handle.block_ids", lambda h: h.block_ids.append(7)),
    ("handle.block_ids", lambda h: h.block_ids.__setitem__(0, 10**9)),
    ("handle.block_ids", lambda h: h.block_ids.__setitem__(1, h.block_ids[0])),
    ("handle.block_hashes", lambda h: h.block_hashes.extend([1, 2, 3, 4])),
    ("handle.block_hashes", lambda h: h.block_hashes.__setitem__(0, h.block_hashes[0] ^ 1)),
    ("handle.block_hashes", lambda h: h.block_hashes.pop()),
    ("handle.lease_expires_at", lambda h: setattr(h, "lease_expires_at", float("nan"))),
    ("handle.descriptor_json", lambda h: setattr(h, "descriptor_json", "[]")),
    ("handle.descriptor_json", lambda h: setattr(h, "descriptor_json", "null")),
    ("handle.descriptor_json", lambda h: setattr(h, "descriptor_json", '"shm"')),
    ("handle.descriptor_json", lambda h: setattr(h, "descriptor_json", "[" * 5000)),
])
def test_forged_handle_fields_are_refused(pd, want, field, forge):
    p, d, decode_proc, connector = pd
    rid = f"forge-{connector}-{field}-{abs(hash(str(forge))) % 10**6}"
    first = prefill(p, rid)
    handle = common_pb2.KVHandle()
    handle.CopyFrom(first.handle)
    forge(handle)
    with pytest.raises(grpc.RpcError) as e:
        decode(d, rid, handle, first.first_token_id)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    still_serves(p, d, decode_proc, want, rid + "-after")


def test_forged_shm_segment_never_touches_another_file(pd, want, tmp_path):
    """A descriptor naming some other file, with a dead 'owner', once made the consumer
    unlink that file. Now the path is checked against the engine's own segment names."""
    p, d, decode_proc, connector = pd
    if connector != "shm":
        pytest.skip("an shm descriptor")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    rid = "forge-shm-path"
    first = prefill(p, rid)
    handle = common_pb2.KVHandle()
    handle.CopyFrom(first.handle)
    descriptor = json.loads(handle.descriptor_json)
    descriptor.update(segment=str(victim), inode=os.stat(victim).st_ino, pid=999_999_999,
                      pid_start=1)
    handle.descriptor_json = json.dumps(descriptor)
    # The load fails and the decode side recomputes the prompt: the answer is still right.
    assert decode(d, rid, handle, first.first_token_id) == want
    assert victim.read_text() == "keep me"
    still_serves(p, d, decode_proc, want, rid + "-after")


def test_forged_lease_token_reads_nothing_and_the_request_is_recomputed(pd, want):
    """A handle whose lease token was tampered with: a tcp producer serves no block for it, a
    nixl producer registers none; the decode side recomputes the prompt, so the answer is
    still right."""
    p, d, decode_proc, connector = pd
    if connector == "shm":
        pytest.skip("shm readers map the producer's segment: the boundary is the host user")
    rid = "forge-lease-token"
    first = prefill(p, rid)
    handle = common_pb2.KVHandle()
    handle.CopyFrom(first.handle)
    handle.lease_token = "x" * len(handle.lease_token)
    stub = engine_pb2_grpc.DecodeStub(grpc.insecure_channel(decode_proc.address))
    before = stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
    assert decode(d, rid, handle, first.first_token_id) == want
    after = stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
    assert after.kv_loads_failed == before.kv_loads_failed + 1  # refused by the producer
    assert after.kv_bytes_received == before.kv_bytes_received
    still_serves(p, d, decode_proc, want, rid + "-after")


def test_more_output_tokens_than_the_context_holds_are_refused(pd, want):
    """A continuation whose tokens already fill the context once killed the decode loop (its
    first step indexed past the rotary table)."""
    p, d, decode_proc, connector = pd
    rid = f"overlong-{connector}"
    first = prefill(p, rid)
    with pytest.raises(grpc.RpcError) as e:
        list(d.Decode(engine_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=PROMPT, handle=first.handle,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=10**6),
            output_token_ids=[first.first_token_id] * 3000), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output_token_ids" in e.value.details()
    still_serves(p, d, decode_proc, want, rid + "-after")


def test_a_handle_for_the_whole_prompt_needs_the_first_token(pd, want):
    """Its KV leaves no prompt token to compute here: the step would sample from a row that
    belongs to nobody (or to another request)."""
    p, d, decode_proc, connector = pd
    rid = f"whole-{connector}"
    first = prefill(p, rid)
    with pytest.raises(grpc.RpcError) as e:
        list(d.Decode(engine_pb2.DecodeRequest(request_id=rid, prompt_token_ids=PROMPT,
                                               sampling=GREEDY, handle=first.handle),
                      timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output_token_ids" in e.value.details()
    still_serves(p, d, decode_proc, want, rid + "-after")


def test_tokens_that_already_complete_a_grammar_fail_only_their_request(pd, want,
                                                                         tiny_model_dir):
    p, d, decode_proc, connector = pd
    if connector != "shm":
        pytest.skip("no KV transfer involved: once is enough")
    tok = LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20).get_tokenizer()
    [a] = tok.encode("a", add_special_tokens=False)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=8)
    sampling.structured_outputs.regex = "a"
    with pytest.raises(grpc.RpcError) as e:
        list(d.Decode(engine_pb2.DecodeRequest(
            request_id="complete", prompt_token_ids=PROMPT, sampling=sampling,
            output_token_ids=[a, tok.eos_token_id]), timeout=30))
    assert "output_token_ids" in e.value.details()
    still_serves(p, d, decode_proc, want, "complete-after")
