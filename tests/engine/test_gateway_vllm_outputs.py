"""vLLM's HTTP extras over a real local engine on the tiny model, compared with `LLM` on the
same model: /tokenize and /detokenize, return_token_ids, prompt_logprobs."""

from __future__ import annotations

import json
import math

import pytest
from starlette.testclient import TestClient

from pdserve import SamplingParams
from pdserve.engine.engine_args import EngineArgs
from pdserve.gateway.app import build_app
from pdserve.gateway.local_backend import LocalBackend

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Say hello"}]
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    backend = LocalBackend.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), kv_cache_memory_bytes=8 << 20, served_model_name="tiny"))
    with TestClient(build_app(backend, "tiny")) as c:
        yield c


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_detokenize_match_the_engine(client, tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    out = post(client, "/tokenize", {"model": "tiny", "prompt": PROMPT})
    expected = tiny_llm.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False)
    assert out["tokens"] == list(expected[0].prompt_token_ids)
    assert out["count"] == len(out["tokens"])
    assert out["max_model_len"] == tiny_llm.llm_engine.config.model.max_model_len
    plain = post(client, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert plain["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    chat = post(client, "/tokenize", {"messages": MESSAGES})
    assert chat["tokens"] == tiny_llm.apply_chat_template(MESSAGES)
    bare = post(client, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["tokens"] == tiny_llm.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert bare["tokens"] != chat["tokens"]
    back = post(client, "/detokenize", {"model": "tiny", "tokens": out["tokens"]})
    assert back == {"prompt": tokenizer.decode(out["tokens"])}
    r = client.post("/detokenize", json={"tokens": [1, len(tokenizer)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_return_token_ids_match_generate(client, tiny_llm):
    ref = tiny_llm.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0]
    out = post(client, "/v1/completions", {"prompt": PROMPT, "return_token_ids": True} | GREEDY)
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == list(ref.prompt_token_ids)
    assert choice["token_ids"] == list(ref.outputs[0].token_ids)

    with client.stream("POST", "/v1/completions", json={
            "prompt": PROMPT, "return_token_ids": True, "stream": True} | GREEDY) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == list(ref.outputs[0].token_ids)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == list(ref.prompt_token_ids)

    ref = tiny_llm.chat(MESSAGES, SamplingParams(**GREEDY), use_tqdm=False)[0]
    out = post(client, "/v1/chat/completions", {"messages": MESSAGES,
                                                "return_token_ids": True} | GREEDY)
    assert out["prompt_token_ids"] == list(ref.prompt_token_ids)
    assert out["choices"][0]["token_ids"] == list(ref.outputs[0].token_ids)
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": MESSAGES, "return_token_ids": True, "stream": True} | GREEDY) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == list(ref.prompt_token_ids)
    streamed = [t for c in chunks[1:] for t in c["choices"][0].get("token_ids", [])]
    assert streamed == list(ref.outputs[0].token_ids)


def test_prompt_logprobs_match_generate(client, tiny_llm):
    k = 3
    ref = tiny_llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=k),
                            use_tqdm=False)[0]
    out = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                           "prompt_logprobs": k})
    got = out["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ref.prompt_logprobs) == len(ref.prompt_token_ids)
    assert got[0] is None and ref.prompt_logprobs[0] is None
    for pos, (g, e, tid) in enumerate(zip(got[1:], ref.prompt_logprobs[1:],
                                          ref.prompt_token_ids[1:])):
        assert set(g) == {str(t) for t in e}, pos
        assert str(tid) in g
        assert len(g) in (k, k + 1)  # the top k, and the prompt token when not among them
        for t, lp in e.items():
            entry = g[str(t)]
            assert math.isclose(entry["logprob"], max(lp.logprob, -9999.0), abs_tol=1e-4)
            assert entry["rank"] == lp.rank
            assert entry["decoded_token"] == (lp.decoded_token or "")
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1,
                                             "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
