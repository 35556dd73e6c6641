"""The gateway app in-process over a scripted fake backend and a character-level tokenizer:
response shapes, backend errors (503, 429, mid-stream), admission, metrics. No model."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from pdserve.gateway.app import build_app
from pdserve.gateway.backend import (
    Backend,
    BackendError,
    BackendOverloaded,
    BackendStats,
    BackendUnavailable,
    Delta,
    DeltaStream,
    ModelInfo,
    ServedBy,
    TokenLogprob,
    Usage,
)

MAX_MODEL_LEN = 64


class CharTokenizer:
    """One token per character; a chat template that tags roles."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True,
                            continue_final_message=False, **kwargs):
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise ValueError("unknown role")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeStream(DeltaStream):
    """Completion i generates tokens 'a', 'b', ... (ids 97, 98, ...) up to max_tokens."""

    def __init__(self, backend, rid, prompt, params):
        self.backend, self.rid = backend, rid
        self.deltas = []
        for i in range(params.n):
            for k in range(params.max_tokens):
                tid = 97 + k
                lp = [TokenLogprob(tid, -0.5, 1, chr(tid)), TokenLogprob(1, -2.0, 2, "#")]
                self.deltas.append(Delta(i, [tid], chr(tid), [lp] if params.logprobs is not None
                                         else None,
                                         "length" if k == params.max_tokens - 1 else None))
        self.deltas[0].prompt_token_ids = list(prompt)
        last = self.deltas[-1]
        last.usage = Usage(len(prompt), params.n * params.max_tokens, 3)
        last.served_by = backend.served_by
        self.done = False

    async def __anext__(self):
        if self.backend.fail_mid and len(self.deltas) == 1:
            raise BackendError("decode instance died")
        if not self.deltas:
            self.done = True
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self.deltas.pop(0)

    async def aclose(self):
        if not self.done and self.deltas:
            self.backend.aborted.append(self.rid)
        self.done = True


class FakeBackend(Backend):
    def __init__(self):
        self.fail_start: Exception | None = None
        self.fail_mid = False
        self.healthy = True
        self.stats_error = False
        self.served_by = None
        self.started = []
        self.cache_salts = []
        self.aborted = []

    async def generate(self, request_id, prompt, params, priority=0, cache_salt=None):
        if self.fail_start is not None:
            raise self.fail_start
        self.started.append((request_id, list(prompt), params))
        self.cache_salts.append(cache_salt)
        return FakeStream(self, request_id, prompt, params)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def health(self):
        return self.healthy

    def models(self):
        return [ModelInfo("fake", "/models/fake", MAX_MODEL_LEN)]

    async def stats(self):
        if self.stats_error:
            raise BackendUnavailable("router down")
        return BackendStats(running_requests=2, waiting_requests=1, free_blocks=30,
                            total_blocks=40, prefix_queries=10, prefix_hits=4,
                            instances={"decode": 1, "prefill": 1})


@pytest.fixture
def backend():
    return FakeBackend()


@pytest.fixture
def client(backend):
    app = build_app(backend, "fake-model", tokenizer=CharTokenizer(), max_concurrency=4,
                    max_body_bytes=4096, close_backend=False)
    with TestClient(app) as c:
        yield c


def events(resp) -> list:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def error(resp, status):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_completion_shape_and_usage(client, backend):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hey",
                                             "max_tokens": 3})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": "abc", "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert backend.started[0][1] == [ord(c) for c in "hey"]


def test_prompts_times_n_choices(client, backend):
    r = client.post("/v1/completions", json={"prompt": [[97, 98], [120, 121]], "n": 2,
                                             "temperature": 1, "max_tokens": 2, "echo": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == ["abab", "abab", "xyab", "xyab"]
    ids = [rid for rid, _, _ in backend.started]
    assert len(set(ids)) == 2 and all(i.endswith(("-0", "-1")) for i in ids)
    assert r.json()["usage"]["prompt_tokens"] == 4


def test_default_max_tokens_fills_context(client, backend):
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    prompt_len = len("<user>hi<assistant>")
    assert backend.started[0][2].max_tokens == MAX_MODEL_LEN - prompt_len


def test_sampling_fields_reach_backend(client, backend):
    client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 2, "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "top_k": 5, "min_p": 0.1, "seed": 4, "stop": "x", "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "repetition_penalty": 1.2, "min_tokens": 1,
        "ignore_eos": True, "stop_token_ids": [7], "skip_special_tokens": False,
        "include_stop_str_in_output": True, "logit_bias": {"5": -1.5}, "logprobs": True,
        "top_logprobs": 3, "user": "u1"})
    p = backend.started[0][2]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop) == \
        (2, 0.5, 0.9, 5, 0.1, 4, ["x"])
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == \
        (0.5, 0.25, 1.2, 1)
    assert p.ignore_eos and p.stop_token_ids == [7] and not p.skip_special_tokens
    assert p.include_stop_str_in_output and p.logit_bias == {5: -1.5} and p.logprobs == 3
    assert backend.started[0][1] == [ord(c) for c in "<user>hi<assistant>"]


def test_chat_stream_shape(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1})
    assert r.headers["content-type"].startswith("text/event-stream")
    ev = events(r)
    assert ev[-1] == "[DONE]"
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and "usage" in e for e in ev[:-1])
    assert [e["choices"][0]["delta"]["content"] for e in ev[1:3]] == ["a", "b"]
    assert ev[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == [
        {"token": "a", "logprob": -0.5, "bytes": [97]}]
    assert ev[2]["choices"][0]["finish_reason"] == "length"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 2


def test_completion_stream_logprobs_offsets(client):
    r = client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3, "stream": True,
                                             "logprobs": 1})
    chunks = [e for e in events(r) if e != "[DONE]"]
    lps = [c["choices"][0]["logprobs"] for c in chunks]
    assert [lp["text_offset"] for lp in lps] == [[0], [1], [2]]
    assert lps[0]["top_logprobs"] == [{"a": -0.5}]
    assert "usage" not in chunks[0]


def test_backend_unavailable_is_503(client, backend):
    backend.fail_start = BackendUnavailable("no decode instance is live")
    err = error(client.post("/v1/completions", json={"prompt": "x"}), 503)
    assert err["code"] == "service_unavailable" and "no decode" in err["message"]
    backend.healthy = False
    assert error(client.get("/health"), 503)["type"] == "service_unavailable_error"


def test_backend_overloaded_is_429(client, backend):
    backend.fail_start = BackendOverloaded("queue full")
    assert error(client.post("/v1/completions", json={"prompt": "x"}), 429)["code"] == \
        "rate_limit_exceeded"


def test_backend_value_error_is_400_naming_the_field(client, backend):
    backend.fail_start = ValueError("prompt_token_ids: token id 99999 is outside the vocabulary")
    assert error(client.post("/v1/completions", json={"prompt": "x"}), 400)["param"] == "prompt"


def test_mid_stream_failure(client, backend):
    backend.fail_mid = True
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
    ev = events(r)
    assert ev[-1] == "[DONE]" and "decode instance died" in ev[-2]["error"]["message"]
    err = error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}), 500)
    assert "decode instance died" in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": "many"}, "n"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x" * MAX_MODEL_LEN}, "prompt"),
])
def test_validation_is_400(client, body, param):
    assert error(client.post("/v1/completions", json=body), 400)["param"] == param


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty", "logit_bias"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")],
                         ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_non_finite_sampling_values_are_400(client, backend, route, field, value):
    # Python's json writes and reads NaN / Infinity; httpx's json= refuses them, so send text.
    body = {"prompt": "x"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}]}
    body[field] = {"5": value} if field == "logit_bias" else value
    r = client.post(route, content=json.dumps(body), headers={"content-type":
                                                                  "application/json"})
    err = error(r, 400)
    assert err["param"] == field and err["type"] == "invalid_request_error"
    assert "finite" in err["message"]
    assert backend.started == []


def test_logprobs_bound_follows_max_logprobs(backend):
    app = build_app(backend, "fake-model", tokenizer=CharTokenizer(), max_logprobs=2,
                    close_backend=False)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True}
    with TestClient(app) as c:
        err = error(c.post("/v1/completions", json={"prompt": "x", "logprobs": 3}), 400)
        assert err["param"] == "logprobs" and "max_logprobs=2" in err["message"]
        err = error(c.post("/v1/chat/completions", json=chat | {"top_logprobs": 3}), 400)
        assert err["param"] == "top_logprobs"
        assert c.post("/v1/chat/completions", json=chat | {"top_logprobs": 2}).status_code == 200
    app = build_app(backend, "fake-model", tokenizer=CharTokenizer(), max_logprobs=-1,
                    close_backend=False)  # vLLM's -1: no cap
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "logprobs": 50, "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert backend.started[-1][2].logprobs == 50


def test_served_model_names(backend):
    app = build_app(backend, ["first", "second"], tokenizer=CharTokenizer(),
                    close_backend=False)
    with TestClient(app) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["first", "second"]
        r = c.post("/v1/completions", json={"model": "second", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "first"
        error(c.post("/v1/completions", json={"model": "third", "prompt": "x"}), 404)


def test_chat_template_failure_is_400(client):
    err = error(client.post("/v1/chat/completions",
                            json={"messages": [{"role": "robot", "content": "x"}]}), 400)
    assert err["param"] == "messages"


def test_routes_errors_in_openai_shape(client):
    assert error(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    error(client.get("/v1/completions"), 405)


def test_body_limit_with_and_without_content_length(client):
    error(client.post("/v1/completions", content=b"x" * 5000), 413)
    chunks = (b"x" * 1000 for _ in range(5))  # chunked: no Content-Length
    error(client.post("/v1/completions", content=chunks), 413)


def test_api_key(backend):
    app = build_app(backend, "fake-model", "k", tokenizer=CharTokenizer(), close_backend=False)
    with TestClient(app) as c:
        error(c.get("/v1/models"), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert c.get("/metrics").status_code == 200


def test_models_and_aliases(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    for name in ("fake", "/models/fake", "fake-model"):
        assert client.post("/v1/completions", json={"model": name, "prompt": "x",
                                                    "max_tokens": 1}).status_code == 200


def metric_values(client) -> dict:
    return {(s.name, s.labels.get("outcome") or s.labels.get("role", "")): s.value
            for f in text_string_to_metric_families(client.get("/metrics").text)
            for s in f.samples}


def test_metrics(client, backend):
    backend.served_by = ServedBy("prefill-0", "decode-0", True, 1, "shm")
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    m = metric_values(client)
    assert m[("pdserve:router_decisions_total", "disaggregated")] == 1
    assert m[("pdserve:generation_tokens_total", "")] == 3
    assert m[("pdserve:num_requests_running", "")] == 2
    assert m[("pdserve:kv_cache_usage_perc", "")] == pytest.approx(0.25)
    assert m[("pdserve:instances", "decode")] == 1
    assert m[("pdserve:prefix_cache_hits_total", "")] == 4
    backend.stats_error = True
    m = metric_values(client)
    assert ("pdserve:num_requests_running", "") not in m
    assert m[("pdserve:e2e_request_latency_seconds_count", "")] == 1


def test_finish_reasons_an_instance_invents_share_one_label():
    from pdserve.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics("m")
    for reason in ("stop", "made-up-1", "made-up-2", None, "length"):
        metrics.finished(reason)
    counts = {s.labels["finished_reason"]: s.value
              for f in text_string_to_metric_families(metrics.render(None).decode())
              for s in f.samples if s.name == "pdserve:request_success_total"}
    assert counts == {"stop": 1, "length": 1, "other": 2, "unknown": 1}


@pytest.mark.parametrize("path, body, bad", [
    ("/v1/completions", {"model": "fake-model", "prompt": "Hi", "max_tokens": 4, "temperature": 0.5},
     {"model": "fake-model", "prompt": "Hi", "max_tokens": "four"}),
    ("/v1/chat/completions",
     {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "top_p": 0.9},
     {"model": "fake-model", "messages": "Hi"}),
])
def test_openapi_documents_the_request_bodies(client, path, body, bad):
    import jsonschema

    doc = client.get("/openapi.json").json()
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = ref["$ref"].rsplit("/", 1)[1]
    schema = {**doc["components"]["schemas"][name], "components": doc["components"]}
    jsonschema.validate(body, schema)  # a request the server accepts fits the schema
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    assert client.post(path, json=body).status_code == 200
    assert client.post(path, json=bad).status_code == 400
