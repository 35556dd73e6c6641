"""vLLM's HTTP extras over the scripted fake backend (no model): /tokenize, /detokenize,
/ping, /invocations, return_token_ids, prompt_logprobs checks, and the warning on ignored
request fields. Outputs against a real engine: tests/engine/test_gateway_vllm_outputs.py."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient
from test_gateway_app import MAX_MODEL_LEN, CharTokenizer, FakeBackend, error, events

from pdserve.gateway.app import build_app

API_KEY = "k"


class SizedCharTokenizer(CharTokenizer):
    def __len__(self):
        return 256


@pytest.fixture
def backend():
    return FakeBackend()


@pytest.fixture
def client(backend):
    app = build_app(backend, "fake-model", API_KEY, tokenizer=SizedCharTokenizer(),
                    close_backend=False)
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def test_tokenize_prompt_and_messages(client):
    r = client.post("/tokenize", json={"model": "fake-model", "prompt": "hey"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": [104, 101, 121]}
    msgs = [{"role": "user", "content": "hi"}]
    r = client.post("/tokenize", json={"messages": msgs})
    assert r.json()["tokens"] == [ord(c) for c in "<user>hi<assistant>"]
    r = client.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False})
    assert r.json()["tokens"] == [ord(c) for c in "<user>hi"]
    assert r.json()["count"] == len("<user>hi")
    assert error(client.post("/tokenize", json={}), 400)["param"] == "prompt"
    assert error(client.post("/tokenize", json={"prompt": "a", "model": "x"}), 404)


def test_detokenize_and_out_of_vocabulary(client):
    r = client.post("/detokenize", json={"model": "fake-model", "tokens": [104, 105]})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "hi"}
    for bad in ([104, 256], [-1]):
        err = error(client.post("/detokenize", json={"tokens": bad}), 400)
        assert err["param"] == "tokens" and "tokens" in err["message"]
    assert error(client.post("/detokenize", json={"tokens": "ab"}), 400)["param"] == "tokens"


def test_ping_and_invocations(client, backend):
    for method in ("GET", "POST"):
        assert client.request(method, "/ping").status_code == 200
    backend.healthy = False
    assert client.get("/ping").status_code == 503
    backend.healthy = True
    r = client.post("/invocations", json={"prompt": "hey", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion" and r.json()["choices"][0]["text"] == "ab"
    r = client.post("/invocations", json={"messages": [{"role": "user", "content": "x"}],
                                          "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    assert error(client.post("/invocations", json={"input": "x"}), 400)
    assert error(client.post("/invocations", json=[1]), 400)
    assert error(client.post("/invocations", json={"prompt": 3}), 400)["param"] == "prompt"


def test_model_endpoints_need_the_api_key(client):
    for path, body in (("/invocations", {"prompt": "a"}), ("/tokenize", {"prompt": "a"}),
                       ("/detokenize", {"tokens": [97]})):
        assert error(client.post(path, json=body, headers={"Authorization": ""}), 401)
    assert client.get("/ping", headers={"Authorization": ""}).status_code == 200


def test_return_token_ids(client):
    r = client.post("/v1/completions", json={"prompt": ["hi", "yo!"], "max_tokens": 2,
                                             "return_token_ids": True})
    choices = r.json()["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [[104, 105], [121, 111, 33]]
    assert [c["token_ids"] for c in choices] == [[97, 98], [97, 98]]
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "n": 2,
        "return_token_ids": True})
    body = r.json()
    assert body["prompt_token_ids"] == [ord(c) for c in "<user>x<assistant>"]
    assert [c["token_ids"] for c in body["choices"]] == [[97, 98, 99]] * 2
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert "token_ids" not in r.json()["choices"][0]
    assert "prompt_token_ids" not in r.json()["choices"][0]


def test_return_token_ids_streaming(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True,
                                             "return_token_ids": True})
    chunks = [e for e in events(r) if e != "[DONE]"]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[97], [98], [99]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [104, 105]
    assert "prompt_token_ids" not in chunks[1]["choices"][0]
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True,
        "return_token_ids": True})
    chunks = [e for e in events(r) if e != "[DONE]"]
    assert chunks[0]["prompt_token_ids"] == [ord(c) for c in "<user>x<assistant>"]
    assert [c["choices"][0]["token_ids"] for c in chunks[1:]] == [[97], [98]]


def test_prompt_logprobs_checks(client):
    body = {"prompt": "hi", "max_tokens": 1, "prompt_logprobs": 21}
    err = error(client.post("/v1/completions", json=body), 400)
    assert err["param"] == "prompt_logprobs" and "max_logprobs" in err["message"]
    err = error(client.post("/v1/completions", json=body | {"prompt_logprobs": 1,
                                                             "stream": True}), 400)
    assert err["param"] == "prompt_logprobs"
    err = error(client.post("/v1/completions", json=body | {"prompt_logprobs": -1}), 400)
    assert err["param"] == "prompt_logprobs"


def test_unknown_fields_are_logged_once_per_name(client):
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    gateway_logger = logging.getLogger("pdserve.gateway")
    gateway_logger.addHandler(handler)
    try:
        body = {"prompt": "hi", "max_tokens": 1, "frobnicate": 1, "zzz": 2}
        for _ in range(2):
            assert client.post("/v1/completions", json=body).status_code == 200
        r = client.post("/v1/completions", json=body | {"other": True})
        assert r.status_code == 200
    finally:
        gateway_logger.removeHandler(handler)
    messages = [r.getMessage() for r in records if r.name == "pdserve.gateway"]
    assert len(messages) == 2, messages
    assert "frobnicate" in messages[0] and "zzz" in messages[0]
    assert "other" in messages[1] and "frobnicate" not in messages[1]
    assert all(r.levelno == logging.WARNING for r in records)


def test_openapi_documents_tokenize_bodies(client):
    doc = client.get("/openapi.json").json()
    for path, name in (("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert ref["schema"]["$ref"].endswith(name)
    assert "tokens" in doc["components"]["schemas"]["DetokenizeRequest"]["properties"]


def test_cache_salt_reaches_the_backend_and_a_bad_one_is_a_400(client, backend):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        r = client.post(path, json={"model": "fake-model", "cache_salt": "tenant-a", **body})
        assert r.status_code == 200, r.text
        assert backend.cache_salts[-1] == "tenant-a"
        assert client.post(path, json={"model": "fake-model", **body}).status_code == 200
        assert backend.cache_salts[-1] is None
        for bad in ("", "s" * 257, 5):
            r = client.post(path, json={"model": "fake-model", "cache_salt": bad, **body})
            assert error(r, 400)["param"] == "cache_salt"


def test_the_models_recommended_settings_fill_what_a_request_leaves_unset():
    """As vLLM's server: the generation config's settings are defaults, a request's own value
    wins, and its max_new_tokens caps an unset max_tokens."""
    from pdserve.gateway.backend import ModelInfo

    class Recommending(FakeBackend):
        def models(self):
            return [ModelInfo("fake", "/models/fake", MAX_MODEL_LEN, sampling_defaults=(
                ("temperature", 0.6), ("top_k", 20), ("max_tokens", 5)))]

    backend = Recommending()
    app = build_app(backend, "fake-model", API_KEY, tokenizer=SizedCharTokenizer(),
                    close_backend=False)
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        params = backend.started[-1][2]
        assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 20, 5)
        r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi",
                                            "temperature": 0.1, "max_tokens": 9})
        assert r.status_code == 200, r.text
        params = backend.started[-1][2]
        assert (params.temperature, params.top_k, params.max_tokens) == (0.1, 20, 9)


def test_an_override_max_new_tokens_caps_even_an_explicit_max_tokens():
    """As vLLM's server: override_generation_config's max_new_tokens (or a generation config
    the user named) caps every request's max_tokens; an over-long request is still a 400."""
    from pdserve.gateway.backend import ModelInfo

    class Capped(FakeBackend):
        def models(self):
            return [ModelInfo("fake", "/models/fake", MAX_MODEL_LEN,
                              sampling_defaults=(("max_tokens", 5),), max_tokens_cap=5)]

    backend = Capped()
    app = build_app(backend, "fake-model", API_KEY, tokenizer=SizedCharTokenizer(),
                    close_backend=False)
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        for asked, given in ((9, 5), (3, 3), (None, 5)):
            r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi",
                                                "max_tokens": asked})
            assert r.status_code == 200, r.text
            assert backend.started[-1][2].max_tokens == given
        r = c.post("/v1/chat/completions", json={
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 40})
        assert r.status_code == 200, r.text
        assert backend.started[-1][2].max_tokens == 5
        r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi",
                                            "max_tokens": MAX_MODEL_LEN + 1})
        assert error(r, 400)["param"] == "max_tokens"
