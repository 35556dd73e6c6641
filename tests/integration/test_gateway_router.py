"""The gateway in front of a real 1P1D cluster (router + prefill + decode processes, shm
connector): `pdserve serve --router ADDR`, driven with the openai client and httpx."""

from __future__ import annotations

import argparse
import json
import time

import grpc
import httpx
import openai
import pytest
from cluster_procs import GatewayProcess
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster, ClusterSpec, free_port
from pdserve.gateway.app import build_app
from pdserve.gateway.router_backend import RouterBackend

KV_BYTES = 8 << 20
THRESHOLD = 16  # prompts of 16+ uncached tokens are prefilled on the prefill instance
WAIT_S = 15
LONG_PROMPT = "In a distant land there was a quiet village where every morning the bakers " \
              "woke before dawn to light their ovens and"


def cli_has(command: str) -> bool:
    from pdserve.cli import build_parser

    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return command in sub.choices


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    if not cli_has("router"):
        pytest.skip("`pdserve router` is not registered in pdserve.cli yet (Cluster runs it)")
    spec = ClusterSpec(model=str(tiny_model_dir), connector="shm", grpc_port=0,
                       disagg_threshold=THRESHOLD, kv_cache_memory_bytes=KV_BYTES,
                       startup_timeout_s=90)
    with Cluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(cluster, tiny_model_dir):
    gw = GatewayProcess("--model", str(tiny_model_dir), "--served-model-name", "tiny",
                        "--router", cluster.router_address)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory_bytes=KV_BYTES)


def samples(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, s.labels.get("outcome", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_greedy_matches_colocated(client, llm, gateway):
    tok = llm.get_tokenizer()
    assert len(tok.encode(LONG_PROMPT)) >= THRESHOLD
    for prompt in (LONG_PROMPT, "Hi there"):  # disaggregated, then decode-only
        want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10),
                            use_tqdm=False)[0].outputs[0].text
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                        temperature=0)
        assert got.choices[0].text == want
        assert got.usage.completion_tokens == 10
    m = samples(gateway.url)
    assert m[("pdserve:router_decisions_total", "disaggregated")] >= 1
    assert m[("pdserve:router_decisions_total", "decode_only")] >= 1


def test_chat_stream_equals_whole_with_logprobs(client):
    kw = {"model": "tiny", "messages": [{"role": "user", "content": LONG_PROMPT}],
              "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**kw).choices[0]
    assert "".join(t.token for t in whole.logprobs.content) == whole.message.content
    assert all(len(t.top_logprobs) == 2 for t in whole.logprobs.content)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.message.content
    assert [t.token for c in chunks if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content] == [t.token for t in whole.logprobs.content]


def test_n_and_seed(client):
    kw = {"model": "tiny", "prompt": LONG_PROMPT + " then", "max_tokens": 6, "n": 2,
          "temperature": 1.0, "seed": 11}
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 12


def test_bad_token_id_is_400(gateway):
    r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": [1, 10**7], "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("extra, param", [
    ({"seed": 2**70}, "seed"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"n": 129}, "n"),  # OpenAI's bound: one request may not fan out without limit
    ({"prompt": [1, 2**40]}, "prompt"),
])
def test_values_the_wire_cannot_carry_are_400_naming_the_field(gateway, extra, param):
    r = httpx.post(f"{gateway.url}/v1/completions",
                   json={"prompt": "Hi", "max_tokens": 2, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_priority_other_than_0_is_400_through_the_router(gateway):
    """The router and its instances schedule first come, first served: priority 0 only."""
    r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                          "priority": 2}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority"
    r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                          "priority": 0}, timeout=30)
    assert r.status_code == 200, r.text


def test_disconnect_frees_blocks_on_every_instance(gateway):
    body = {"prompt": LONG_PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=gateway.url, timeout=30) as c, \
            c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # NOTE: dropping it closes the connection
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + WAIT_S
    while True:
        m = samples(gateway.url)
        free, total = (m[("pdserve:kv_cache_free_blocks", "")],
                       m[("pdserve:kv_cache_total_blocks", "")])
        if free == total and m[("pdserve:num_requests_running", "")] == 0:
            break
        assert time.monotonic() < deadline, f"blocks still held after {WAIT_S}s: {m}"
        time.sleep(0.2)


def test_router_unreachable_is_503(tiny_model_dir):
    backend = RouterBackend(f"127.0.0.1:{free_port('127.0.0.1')}", str(tiny_model_dir))
    with TestClient(build_app(backend, "tiny")) as c:
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "service_unavailable"
        assert c.get("/metrics").status_code == 200


def test_tool_choice_required_through_the_cluster(client, llm):
    """HTTP -> router -> prefill -> decode with a grammar: the calls validate against the tool's
    schema and equal the colocated engine's constrained output."""
    import jsonschema

    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                      "maximum": 99}}, "required": ["n"]}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": params}}]
    named = {"type": "function", "function": {"name": "pick"}}
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": LONG_PROMPT}], tools=tools,
        tool_choice=named, max_tokens=40, temperature=0,
        extra_body={"return_token_ids": True})
    (call,) = out.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, params)
    prompt_ids = out.model_extra["prompt_token_ids"]
    [want] = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(
        temperature=0, max_tokens=40, structured_outputs={"json": params, "disable_any_whitespace": True}),
        use_tqdm=False)
    assert arguments == json.loads(want.outputs[0].text)


def test_beam_search_through_the_cluster(client, llm):
    """use_beam_search through HTTP -> router -> instances: the gateway's beam search over
    one-token requests gives the beams of LLM.beam_search on a colocated engine."""
    from pdserve import BeamSearchParams

    [want] = llm.beam_search(LONG_PROMPT, BeamSearchParams(beam_width=2, max_tokens=4))
    out = client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=4, n=2,
                                    temperature=0, extra_body={"use_beam_search": True})
    assert [c.text for c in out.choices] == [b.text for b in want.sequences]


def test_embeddings_through_the_cluster(client, llm, cluster):
    """/v1/embeddings -> router -> an instance's Pooling service: the embeddings of
    LLM.embed on a colocated engine; the router computes them on the prefill instance."""
    import torch

    from pdserve import PoolingParams
    from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    prompts = [LONG_PROMPT, "Hi there"]
    out = client.embeddings.create(model="tiny", input=prompts)
    want = llm.embed(prompts, use_tqdm=False)
    assert [d.index for d in out.data] == [0, 1]
    for d, w in zip(out.data, want, strict=True):
        assert torch.allclose(torch.tensor(d.embedding), torch.tensor(w.outputs.embedding),
                              atol=1e-4)
    assert out.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    cut = client.embeddings.create(model="tiny", input=LONG_PROMPT, dimensions=8)
    [w8] = llm.embed(LONG_PROMPT, PoolingParams(dimensions=8), use_tqdm=False)
    assert torch.allclose(torch.tensor(cut.data[0].embedding), torch.tensor(w8.outputs.embedding),
                          atol=1e-4)
    # Over gRPC: the instance that computed it, and the tokens embedded.
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    resp = stub.Embed(router_pb2.EmbedRequest(
        text=LONG_PROMPT, pooling=common_pb2.PoolingParams(truncate_prompt_tokens=5)), timeout=60)
    [w5] = llm.embed(LONG_PROMPT, PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)
    assert resp.instance_id == "prefill-0" and resp.prompt_tokens == 5
    assert torch.allclose(torch.tensor(list(resp.embedding)), torch.tensor(w5.outputs.embedding),
                          atol=1e-4)


@pytest.mark.parametrize("body, param", [
    ({"input": "hello", "dimensions": 10**6}, "dimensions"),  # checked by the instance
    ({"input": "hello", "dimensions": 0}, "dimensions"),
    ({"input": [], "dimensions": 4}, "input"),
    ({"input": [1, 10**7]}, "input"),
])
def test_bad_embedding_requests_are_400_through_the_cluster(gateway, body, param):
    r = httpx.post(f"{gateway.url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("prompt, pooling, field", [
    ({}, {}, "prompt"),
    ({"token_ids": {"ids": []}}, {}, "prompt"),
    ({"token_ids": {"ids": [5, -3]}}, {}, "prompt.token_ids"),
    ({"token_ids": {"ids": list(range(10, 40))}}, {"dimensions": 0}, "pooling.dimensions"),
    ({"token_ids": {"ids": list(range(10, 40))}}, {"truncate_prompt_tokens": -7},
     "pooling.truncate_prompt_tokens"),
    ({"token_ids": {"ids": list(range(10, 40))}}, {"dimensions": 10**6}, "dimensions"),
    ({"token_ids": {"ids": [1] * 5000}}, {}, "prompt"),
])
def test_router_embed_invalid_arguments(cluster, prompt, pooling, field):
    from google.protobuf.json_format import ParseDict

    from pdserve.proto.pdserve.v1 import router_pb2, router_pb2_grpc

    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    request = ParseDict({**prompt, "pooling": pooling}, router_pb2.EmbedRequest())
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(request, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()


def test_prompt_logprobs_through_the_cluster(client, llm, gateway):
    """prompt_logprobs from the prefill instance (disaggregated) or the decode instance
    (short prompt), equal to a colocated engine's; the generation is unchanged."""
    fresh = "Far beyond the mountains, " + LONG_PROMPT  # in no prefix cache yet
    for prompt, outcome in ((fresh, "disaggregated"), ("Hi there", "decode_only")):
        before = samples(gateway.url).get(("pdserve:router_decisions_total", outcome), 0)
        ids = llm.get_tokenizer().encode(prompt)
        [ref] = llm.generate({"prompt_token_ids": ids}, SamplingParams(
            temperature=0, max_tokens=6, prompt_logprobs=2), use_tqdm=False)
        out = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                        extra_body={"prompt_logprobs": 2})
        choice = out.choices[0]
        assert choice.text == ref.outputs[0].text
        assert samples(gateway.url)[("pdserve:router_decisions_total", outcome)] == before + 1
        got = choice.model_extra["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for pos, want, tid in zip(got[1:], ref.prompt_logprobs[1:], ids[1:], strict=True):
            assert set(pos) == {str(t) for t in want}
            assert pos[str(tid)]["rank"] == want[tid].rank
            assert pos[str(tid)]["logprob"] == pytest.approx(want[tid].logprob, abs=1e-4)


@pytest.mark.parametrize("fields, field", [
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 10**7]}, "prompt_token_ids"),
    ({"prompt_token_ids": [5, 6], "pooling": {"dimensions": -4}}, "pooling.dimensions"),
    ({"prompt_token_ids": [5, 6], "pooling": {"dimensions": 10**6}}, "dimensions"),
    ({"prompt_token_ids": [5] * 5000}, "prompt"),
])
def test_instance_embed_refuses_bad_fields_and_keeps_serving(cluster, llm, fields, field):
    """An instance's Pooling.Embed, called directly: each bad field is INVALID_ARGUMENT
    naming it, and the instance goes on answering embeddings."""
    import torch
    from google.protobuf.json_format import ParseDict

    from pdserve.proto.pdserve.v1 import engine_pb2, engine_pb2_grpc

    stub = engine_pb2_grpc.PoolingStub(grpc.insecure_channel(cluster.child("decode-0").address))
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(ParseDict(fields, engine_pb2.EmbedPromptRequest()), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()
    ids = llm.get_tokenizer().encode("Hi there")
    ok = stub.Embed(engine_pb2.EmbedPromptRequest(prompt_token_ids=ids), timeout=30)
    [want] = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
    assert ok.instance_id == "decode-0" and ok.prompt_tokens == len(ids)
    assert torch.allclose(torch.tensor(list(ok.embedding)), torch.tensor(want.outputs.embedding),
                          atol=1e-4)
