"""The OpenAI-format gateway over a local engine (`pdserve serve`), as a real server process on
loopback: the official `openai` client for the happy paths, httpx for every error status,
client disconnects, and /metrics."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from cluster_procs import GatewayProcess
from prometheus_client.parser import text_string_to_metric_families

from pdserve import LLM, SamplingParams

API_KEY = "test-key"
MAX_CONCURRENCY = 3
MAX_BODY_BYTES = 64 << 10
KV_BYTES = 8 << 20
WAIT_S = 10
LONG = {"max_tokens": 1500, "ignore_eos": True}  # runs until aborted, for all practical purposes


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    gw = GatewayProcess("--model", str(tiny_model_dir), "--served-model-name", "tiny",
                        "--api-key", API_KEY, "--max-concurrency", str(MAX_CONCURRENCY),
                        "--max-body-bytes", str(MAX_BODY_BYTES),
                        "--kv-cache-memory-bytes", str(KV_BYTES),
                        # vLLM's server flags, through a real uvicorn (a proxy in front would
                        # strip the root path; the key is still checked behind it)
                        "--uvicorn-log-level", "warning", "--root-path", "/proxy",
                        "--allowed-origins", '["https://ui.example"]')
    yield gw
    gw.stop()
    assert gw.proc.returncode == 0, "".join(gw.log[-30:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory_bytes=KV_BYTES)


def metrics(http) -> dict[str, float]:
    """Sample name -> value (labels dropped; each metric here has one series per name)."""
    text = http.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = s.value
    return out


def wait_all_free(http) -> dict[str, float]:
    deadline = time.monotonic() + WAIT_S
    while True:
        m = metrics(http)
        if (m["pdserve:kv_cache_free_blocks"] == m["pdserve:kv_cache_total_blocks"]
                and m["pdserve:num_requests_running"] == 0
                and m["pdserve:num_requests_waiting"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held after {WAIT_S}s: {m}")
        time.sleep(0.05)


# ---------------------------------------------------------------- the openai client

def test_models_health_version(client, http):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_greedy_completion_matches_llm_generate(client, llm):
    prompts = ["The capital of France is", "Once upon a time"]
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    got = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == \
        [o.outputs[0].text for o in want]
    assert got.usage.completion_tokens == 24
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    assert got.usage.total_tokens == got.usage.prompt_tokens + 24
    assert got.choices[0].finish_reason == "length"


def test_token_id_prompts_and_echo(client, llm):
    ids = llm.get_tokenizer().encode("Hello world, this is")
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6),
                        use_tqdm=False)[0].outputs[0].text
    got = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=6,
                                    temperature=0, echo=True)
    prompt_text = llm.get_tokenizer().decode(ids)
    assert [c.text for c in got.choices] == [prompt_text + want] * 2


def test_streaming_completion_equals_whole(client):
    kw = {"model": "tiny", "prompt": "Streaming is", "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_greedy_matches_llm_chat(client, llm):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                         temperature=0)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_n_and_usage(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=7,
        n=2, temperature=1.0, seed=3, stream=True, stream_options={"include_usage": True})
    texts, finish, roles = {0: "", 1: ""}, {}, set()
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0, 1} and finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 14
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=7, n=2,
        temperature=1.0, seed=3)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]


def test_seed_reproducible(client):
    kw = {"model": "tiny", "prompt": "Random words:", "max_tokens": 10, "temperature": 1.0}
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    assert a == b != c


def test_stop_string(client):
    kw = {"model": "tiny", "prompt": "The capital of France is", "temperature": 0}
    full = client.completions.create(max_tokens=12, **kw).choices[0].text
    stop = full[4:7]
    assert stop.strip(), full
    got = client.completions.create(max_tokens=12, stop=[stop], **kw).choices[0]
    assert got.text == full[:full.index(stop)]
    assert got.finish_reason == "stop"
    kept = client.completions.create(max_tokens=12, stop=[stop], **kw,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(stop) + len(stop)]


def test_completion_logprobs(client):
    got = client.completions.create(model="tiny", prompt="Numbers:", max_tokens=4,
                                    temperature=0, logprobs=3).choices[0]
    lp = got.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == got.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        assert top[token] == value == max(top.values())  # greedy: the sampled one is the top


def test_chat_logprobs(client):
    got = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2).choices[0]
    content = got.logprobs.content
    assert "".join(t.token for t in content) == got.message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.bytes == list(t.token.encode())


def test_vllm_extras(client, llm):
    tok = llm.get_tokenizer()
    first = client.completions.create(model="tiny", prompt="Hello", max_tokens=1,
                                      temperature=0).choices[0].text
    banned = tok.encode(first)[0]
    got = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=3, temperature=0.8, seed=1,
        logit_bias={str(banned): -100},
        extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 3,
                    "stop_token_ids": [tok.eos_token_id]})
    assert got.usage.completion_tokens == 3
    assert not got.choices[0].text.startswith(first)


# ---------------------------------------------------------------- errors

def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "temperature": -1}, "temperature"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "n": 129}, "n"),  # OpenAI's bound
    ({**CHAT, "seed": 1 << 64}, "seed"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": 10**6}, "max_tokens"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"content": "no role"}]}, "messages"),
    ({**CHAT, "logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"model": "tiny", "max_tokens": 2}, "prompt"),
])
def test_bad_fields_are_400(http, body, param):
    path = "/v1/completions" if "messages" not in body else "/v1/chat/completions"
    err = error_of(http.post(path, json=body), 400)
    assert err["param"] == param and param in err["message"]
    assert err["type"] == "invalid_request_error"


def test_bad_prompts_are_400(http):
    for prompt in ("", [], [[]], [1, 2, 10**9]):
        err = error_of(http.post("/v1/completions", json={"prompt": prompt}), 400)
        assert err["param"] == "prompt", err


def test_malformed_json_is_400(http):
    err = error_of(http.post("/v1/chat/completions", content=b'{"messages": [',
                             headers={"Content-Type": "application/json"}), 400)
    assert "JSON" in err["message"]
    error_of(http.post("/v1/completions", content=b"[1, 2]"), 400)


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        err = error_of(httpx.post(f"{server.url}/v1/chat/completions", json=CHAT,
                                  headers=headers, timeout=10), 401)
        assert err["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong",
                      max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # not under /v1
    preflight = httpx.options(f"{server.url}/v1/completions", timeout=10, headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST"})
    assert preflight.headers.get("access-control-allow-origin") == "https://ui.example"
    other = httpx.options(f"{server.url}/v1/completions", timeout=10, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


def test_unknown_model_is_404(http, client):
    err = error_of(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)


def test_body_too_large_is_413(http):
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}
    error_of(http.post("/v1/chat/completions", json=body), 413)


def test_over_concurrency_is_429_then_blocks_freed(server, http):
    with httpx.Client(base_url=server.url, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as hog:
        streams = []
        for i in range(MAX_CONCURRENCY):
            s = hog.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": f"hog {i}", "stream": True, **LONG})
            resp = s.__enter__()
            assert resp.status_code == 200
            lines = resp.iter_lines()  # NOTE: dropping this iterator closes the connection
            next(lines)  # the request is running
            streams.append((s, lines))
        err = error_of(http.post("/v1/completions", json={"prompt": "one more",
                                                           "max_tokens": 1}), 429)
        assert err["type"] == "rate_limit_error"
        for s, _ in streams:
            s.__exit__(None, None, None)
    wait_all_free(http)
    assert http.post("/v1/completions", json={"prompt": "now", "max_tokens": 1}).status_code \
        == 200


# ---------------------------------------------------------------- disconnects, metrics

def content_lines(resp, count: int):
    """The open response's line iterator, after `count` chunks with content.
    NOTE: the caller keeps the iterator: dropping it closes the connection."""
    lines = resp.iter_lines()
    seen = 0
    while seen < count:
        line = next(lines)
        if line.startswith("data: {") and \
                json.loads(line[6:])["choices"][0]["delta"].get("content"):
            seen += 1
    return lines


def test_stream_disconnect_aborts_and_frees_blocks(server, http):
    with httpx.Client(base_url=server.url, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c, \
            c.stream("POST", "/v1/chat/completions",
                     json={**CHAT, "stream": True, **LONG}) as resp:
        lines = content_lines(resp, 3)
        m = metrics(http)
        assert m["pdserve:num_requests_running"] == 1
        assert m["pdserve:kv_cache_free_blocks"] < m["pdserve:kv_cache_total_blocks"]
        del lines
    wait_all_free(http)


def test_non_streaming_disconnect_aborts(server, http):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "wait", **LONG},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=1.0)
    wait_all_free(http)


def test_metrics(http, client):
    assert http.post("/v1/completions", json={"prompt": "x", "n": 0}).status_code == 400
    before = metrics(http)
    client.completions.create(model="tiny", prompt="Count the tokens", max_tokens=5,
                              temperature=0)
    client.completions.create(model="tiny", prompt="Count the tokens", max_tokens=5,
                              temperature=0)
    m = metrics(http)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert m[f"pdserve:{name}_count"] == before[f"pdserve:{name}_count"] + 2
    assert m["pdserve:inter_token_latency_seconds_count"] >= \
        before["pdserve:inter_token_latency_seconds_count"] + 8
    assert m["pdserve:generation_tokens_total"] == before["pdserve:generation_tokens_total"] + 10
    assert m["pdserve:prompt_tokens_total"] > before["pdserve:prompt_tokens_total"]
    assert m["pdserve:prefix_cache_queries_total"] >= m["pdserve:prefix_cache_hits_total"] >= 0
    assert 0 <= m["pdserve:kv_cache_usage_perc"] <= 1
    assert m["pdserve:http_requests_rejected_total"] >= 1  # the error tests above
