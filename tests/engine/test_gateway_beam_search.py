"""use_beam_search over HTTP (completions and chat, whole and streamed) through the gateway's
generic beam search, against LLM.beam_search on the same engine weights."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from pdserve import BeamSearchParams, EngineArgs
from pdserve.gateway.app import build_app
from pdserve.gateway.local_backend import LocalBackend

PROMPT = "The old lighthouse keeper said"


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    backend = LocalBackend.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), kv_cache_memory_bytes=8 << 20, served_model_name="tiny"))
    with TestClient(build_app(backend, "tiny")) as c:
        yield c


def test_completions_beams_equal_llm_beam_search(client, tiny_llm):
    [want] = tiny_llm.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=6))
    body = {"prompt": PROMPT, "max_tokens": 6, "n": 3, "use_beam_search": True,
            "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == [b.text for b in want.sequences]
    assert [c["finish_reason"] for c in choices] == [b.finish_reason for b in want.sequences]
    prompt_len = len(tiny_llm.get_tokenizer().encode(PROMPT))
    assert r.json()["usage"]["completion_tokens"] == sum(
        len(b.tokens) - prompt_len for b in want.sequences)
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
        texts: dict[int, str] = {}
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(3)] == [b.text for b in want.sequences]


def test_chat_beam_search(client, tiny_llm):
    messages = [{"role": "user", "content": "Tell me a story."}]
    ids = tiny_llm.llm_engine.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    [want] = tiny_llm.beam_search({"prompt_token_ids": tiny_llm.get_tokenizer().encode(
        ids, add_special_tokens=False)}, BeamSearchParams(beam_width=2, max_tokens=5))
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5,
                                                  "n": 2, "use_beam_search": True})
    assert r.status_code == 200, r.text
    got = [c["message"]["content"] for c in r.json()["choices"]]
    assert got == [b.text for b in want.sequences]


@pytest.mark.parametrize("extra, param", [
    ({"n": 11}, "n"),  # 22 logprobs per step, above max_logprobs=20
    ({"logprobs": 2}, "logprobs"),
    ({"structured_outputs": {"regex": "a+"}}, "use_beam_search"),
    ({"length_penalty": "x"}, None),
])
def test_beam_search_refusals(client, extra, param):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "n": 2,
                                             "use_beam_search": True, **extra})
    assert r.status_code == 400, r.text
    if param:
        assert r.json()["error"]["param"] == param
