"""What one HTTP request may ask of the gateway: its backend requests (prompts, beams, inputs)
within --max-concurrency, chat_template_kwargs holding only the template's variables, at most
128 tools, bounded lists checked at every token, and JSON no deeper than Python can parse."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from test_gateway_app import CharTokenizer, FakeBackend, error

from pdserve.gateway.app import build_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class EmbeddingBackend(FakeBackend):
    async def embed(self, request_id, prompt_ids, pooling):
        self.started.append((request_id, list(prompt_ids), pooling))
        return [1.0, 0.0]


@pytest.fixture
def backend():
    return EmbeddingBackend()


@pytest.fixture
def client(backend):
    app = build_app(backend, "fake-model", tokenizer=CharTokenizer(), max_concurrency=4,
                    max_body_bytes=1 << 20, close_backend=False)
    with TestClient(app) as c:
        yield c


def test_each_prompt_takes_a_slot_of_max_concurrency(client, backend):
    err = error(client.post("/v1/completions", json={"prompt": [[97]] * 5, "max_tokens": 1}),
                400)
    assert err["param"] == "prompt" and "--max-concurrency" in err["message"]
    assert backend.started == []  # refused before any backend request
    r = client.post("/v1/completions", json={"prompt": [[97]] * 4, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    admission = client.app.state.admission
    admission.enter(3)  # three backend requests in flight
    try:
        err = error(client.post("/v1/completions", json={"prompt": [[97]] * 2,
                                                          "max_tokens": 1}), 429)
        assert err["code"] == "rate_limit_exceeded"
        assert client.post("/v1/completions", json={"prompt": [97], "max_tokens": 1}) \
            .status_code == 200
    finally:
        admission.leave(3)
    assert admission.in_flight == 0


def test_each_beam_and_each_embedding_input_takes_a_slot(client, backend):
    body = {**CHAT, "use_beam_search": True, "n": 5, "temperature": 0}
    assert error(client.post("/v1/chat/completions", json=body), 400)["param"] == "n"
    err = error(client.post("/v1/embeddings", json={"input": ["a"] * 5}), 400)
    assert err["param"] == "input" and backend.started == []
    r = client.post("/v1/embeddings", json={"input": ["a"] * 4})
    assert r.status_code == 200 and len(r.json()["data"]) == 4
    assert client.app.state.admission.in_flight == 0


@pytest.mark.parametrize("kwargs", [{"chat_template": "{{ 'mine' }}"}, {"tokenize": True},
                                    {"tools": []}, {"add_generation_prompt": False}])
def test_chat_template_kwargs_hold_only_template_variables(client, kwargs):
    """A `chat_template` here would render the caller's Jinja on the server (vLLM's
    CVE-2025-61620); apply_chat_template's other arguments would change the call itself."""
    for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", {"messages":
                                                                      CHAT["messages"]})):
        err = error(client.post(path, json={**body, "chat_template_kwargs": kwargs}), 400)
        assert err["param"] == "chat_template_kwargs" and next(iter(kwargs)) in err["message"]
    ok = client.post("/v1/chat/completions",
                     json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                        for i in range(129)]}, "tools"),
    ({**CHAT, "stop": ["x"] * 129}, "stop"),
    ({**CHAT, "stop_token_ids": [5] * 1025}, "stop_token_ids"),
    ({**CHAT, "bad_words": ["x"] * 1025}, "bad_words"),
    ({**CHAT, "bad_words": ["x" * 257]}, "bad_words"),
    ({**CHAT, "n": 129, "temperature": 1}, "n"),
])
def test_lists_checked_at_every_token_are_bounded(client, backend, body, param):
    assert error(client.post("/v1/chat/completions", json=body), 400)["param"] == param
    assert backend.started == []


def test_json_nested_too_deeply_is_400(client):
    err = error(client.post("/v1/completions", content=b"[" * 5000), 400)
    assert "nested too deeply" in err["message"]
    body = {**CHAT, "guided_json": "[" * 5000}  # a schema as a string, parsed here
    assert "nested too deeply" in error(client.post("/v1/chat/completions", json=body),
                                        400)["message"]
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
