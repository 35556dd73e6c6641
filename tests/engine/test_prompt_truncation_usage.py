"""truncate_prompt_tokens (offline and HTTP), stream_options.continuous_usage_stats, chat
prompt_logprobs, logprob_token_ids / flat_logprobs: each compared with the engine run
without the feature on the tiny model."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from pdserve import SamplingParams
from pdserve.engine.engine_args import EngineArgs
from pdserve.gateway.app import build_app
from pdserve.gateway.local_backend import LocalBackend

PROMPT = "Once upon a time in a land far away there lived a dragon who loved books"
MESSAGES = [{"role": "user", "content": "Tell me a story about a dragon"}]
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
K = 5


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**(GREEDY | kw))


# --- offline: LLM.generate -------------------------------------------------------------------

def test_truncation_runs_the_last_k_tokens(tiny_llm):
    ids = tiny_llm.get_tokenizer().encode(PROMPT)
    assert len(ids) > K
    [out] = tiny_llm.generate(PROMPT, greedy(truncate_prompt_tokens=K, prompt_logprobs=1),
                              use_tqdm=False)
    [ref] = tiny_llm.generate({"prompt_token_ids": ids[-K:]}, greedy(prompt_logprobs=1),
                              use_tqdm=False)
    [full] = tiny_llm.generate(PROMPT, greedy(prompt_logprobs=1), use_tqdm=False)
    assert list(out.prompt_token_ids) == ids[-K:]
    assert list(full.prompt_token_ids) == ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.outputs[0].text == ref.outputs[0].text
    assert len(out.prompt_logprobs) == K
    assert [None if p is None else sorted(p) for p in out.prompt_logprobs] == [
        None if p is None else sorted(p) for p in ref.prompt_logprobs]
    # Enough room kept: nothing cut; -1 keeps up to the model's max length.
    for k in (len(ids), len(ids) + 3, -1):
        [same] = tiny_llm.generate(PROMPT, greedy(truncate_prompt_tokens=k), use_tqdm=False)
        assert list(same.prompt_token_ids) == ids
        assert same.outputs[0].token_ids == full.outputs[0].token_ids


def test_truncation_lets_an_overlong_prompt_run(tiny_llm):
    long_prompt = "word " * 3000
    with pytest.raises(ValueError, match="max_model_len"):
        tiny_llm.generate(long_prompt, greedy(), use_tqdm=False)
    [out] = tiny_llm.generate(long_prompt, greedy(truncate_prompt_tokens=8), use_tqdm=False)
    ids = tiny_llm.get_tokenizer().encode(long_prompt)
    assert list(out.prompt_token_ids) == ids[-8:]
    assert len(out.outputs[0].token_ids) == GREEDY["max_tokens"]


def test_truncation_above_max_model_len_is_a_value_error(tiny_llm):
    max_len = tiny_llm.llm_engine.config.model.max_model_len
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        tiny_llm.generate(PROMPT, greedy(truncate_prompt_tokens=max_len + 1), use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_flat_logprobs_returns_the_usual_logprobs(tiny_llm):
    [plain] = tiny_llm.generate(PROMPT, greedy(logprobs=3), use_tqdm=False)
    [flat] = tiny_llm.generate(PROMPT, greedy(logprobs=3, flat_logprobs=True), use_tqdm=False)
    assert flat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert flat.outputs[0].logprobs == plain.outputs[0].logprobs


def test_logprob_token_ids_checked_and_empty_asks_nothing_more(tiny_llm):
    vocab = tiny_llm.llm_engine.config.model.arch.vocab_size
    with pytest.raises(ValueError, match="logprob_token_ids"):
        tiny_llm.generate(PROMPT, greedy(logprobs=1, logprob_token_ids=[vocab]), use_tqdm=False)
    [plain] = tiny_llm.generate(PROMPT, greedy(logprobs=1), use_tqdm=False)
    [out] = tiny_llm.generate(PROMPT, greedy(logprobs=1, logprob_token_ids=[]), use_tqdm=False)
    assert out.outputs[0].logprobs == plain.outputs[0].logprobs
    assert not tiny_llm.llm_engine.has_unfinished_requests()


# --- HTTP ------------------------------------------------------------------------------------

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


def events(client, path: str, body: dict) -> list[dict]:
    r = client.post(path, json=body | {"stream": True})
    assert r.status_code == 200, r.text
    out = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


def bad(client, path: str, body: dict, param: str) -> str:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    return r.json()["error"]["message"]


def test_http_completion_truncation_matches_generate(client, tiny_llm):
    ids = tiny_llm.get_tokenizer().encode(PROMPT)
    [ref] = tiny_llm.generate({"prompt_token_ids": ids[-K:]}, greedy(), use_tqdm=False)
    out = post(client, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": K,
                                           "return_token_ids": True, "echo": True} | GREEDY)
    choice = out["choices"][0]
    assert out["usage"]["prompt_tokens"] == K
    assert choice["prompt_token_ids"] == ids[-K:]
    assert choice["token_ids"] == list(ref.outputs[0].token_ids)
    echoed = tiny_llm.get_tokenizer().decode(ids[-K:])
    assert choice["text"] == echoed + ref.outputs[0].text
    full = post(client, "/v1/completions", {"prompt": PROMPT} | GREEDY)
    assert full["usage"]["prompt_tokens"] == len(ids)
    # An overlong prompt is served once truncated.
    long_ids = [ids[1]] * 5000
    out = post(client, "/v1/completions", {"prompt": long_ids, "truncate_prompt_tokens": 10}
               | GREEDY)
    assert out["usage"]["prompt_tokens"] == 10


def test_http_truncation_errors_name_the_field(client):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        for value in (0, -2, 10 ** 6):
            msg = bad(client, path, body | {"truncate_prompt_tokens": value},
                      "truncate_prompt_tokens")
            assert "truncate_prompt_tokens" in msg


def test_http_chat_truncation_matches_generate(client, tiny_llm):
    ids = tiny_llm.apply_chat_template(MESSAGES)
    [ref] = tiny_llm.generate({"prompt_token_ids": ids[-K:]}, greedy(), use_tqdm=False)
    out = post(client, "/v1/chat/completions", {"messages": MESSAGES, "return_token_ids": True,
                                                "truncate_prompt_tokens": K} | GREEDY)
    assert out["prompt_token_ids"] == ids[-K:]
    assert out["usage"]["prompt_tokens"] == K
    assert out["choices"][0]["token_ids"] == list(ref.outputs[0].token_ids)


def _check_continuous(chunks: list[dict], prompt_tokens: int, n: int) -> None:
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == prompt_tokens
    seen = {i: 0 for i in range(n)}
    for chunk in body:
        [choice] = chunk["choices"]
        usage = chunk["usage"]
        seen[choice["index"]] += len(choice["token_ids"])
        assert usage == {"prompt_tokens": prompt_tokens,
                         "completion_tokens": seen[choice["index"]],
                         "total_tokens": prompt_tokens + seen[choice["index"]]}
    assert seen == {i: GREEDY["max_tokens"] for i in range(n)}
    assert last["usage"]["completion_tokens"] == n * GREEDY["max_tokens"]


def test_completion_stream_continuous_usage(client, tiny_llm):
    n_prompt = len(tiny_llm.get_tokenizer().encode(PROMPT))
    body = {"prompt": PROMPT, "return_token_ids": True} | GREEDY
    chunks = events(client, "/v1/completions", body | {
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    _check_continuous(chunks, n_prompt, 1)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == (
        post(client, "/v1/completions", body)["choices"][0]["text"])
    # n = 2 sampled: each choice counts its own tokens.
    sampled = body | {"n": 2, "temperature": 1.0, "seed": 3}
    chunks = events(client, "/v1/completions", sampled | {
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    _check_continuous(chunks, n_prompt, 2)
    # include_usage alone: null on the chunks, usage at the end (unchanged).
    chunks = events(client, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    # continuous_usage_stats without include_usage: no usage at all (as vLLM).
    chunks = events(client, "/v1/completions",
                    body | {"stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in chunks) and all(c["choices"] for c in chunks)


def test_chat_stream_continuous_usage(client, tiny_llm):
    n_prompt = len(tiny_llm.apply_chat_template(MESSAGES))
    body = {"messages": MESSAGES, "return_token_ids": True} | GREEDY
    chunks = events(client, "/v1/chat/completions", body | {
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    role = chunks[0]
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert role["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0,
                             "total_tokens": n_prompt}
    for c in chunks[1:-1]:
        c["choices"][0].setdefault("token_ids", [])
    _check_continuous(chunks[1:], n_prompt, 1)
    assert chunks[-1]["usage"]["total_tokens"] == n_prompt + GREEDY["max_tokens"]
    plain = events(client, "/v1/chat/completions",
                   body | {"stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1])
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [plain[-1]["usage"][k] for k in counts] == [chunks[-1]["usage"][k] for k in counts]


def test_chat_prompt_logprobs_match_completions_and_generate(client, tiny_llm):
    ids = tiny_llm.apply_chat_template(MESSAGES)
    chat = post(client, "/v1/chat/completions",
                {"messages": MESSAGES, "prompt_logprobs": 2} | GREEDY)
    comp = post(client, "/v1/completions", {"prompt": ids, "prompt_logprobs": 2} | GREEDY)
    assert chat["prompt_logprobs"] == comp["choices"][0]["prompt_logprobs"]
    assert len(chat["prompt_logprobs"]) == len(ids) and chat["prompt_logprobs"][0] is None
    [ref] = tiny_llm.generate({"prompt_token_ids": ids}, greedy(prompt_logprobs=2),
                              use_tqdm=False)
    for got, want, tid in zip(chat["prompt_logprobs"][1:], ref.prompt_logprobs[1:], ids[1:]):
        assert set(got) == {str(t) for t in want}
        assert got[str(tid)]["rank"] == want[tid].rank
        assert got[str(tid)]["logprob"] == pytest.approx(want[tid].logprob, abs=1e-4)
    # Truncated: the logprobs of the kept tokens only.
    cut = post(client, "/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 0,
                                                "truncate_prompt_tokens": K} | GREEDY)
    assert len(cut["prompt_logprobs"]) == K
    assert "prompt_logprobs" not in post(client, "/v1/chat/completions",
                                         {"messages": MESSAGES} | GREEDY)


def test_chat_prompt_logprobs_errors(client):
    body = {"messages": MESSAGES} | GREEDY
    bad(client, "/v1/chat/completions", body | {"prompt_logprobs": 1, "stream": True},
        "prompt_logprobs")
    bad(client, "/v1/chat/completions", body | {"prompt_logprobs": 21}, "prompt_logprobs")
    r = client.post("/v1/chat/completions", json=body | {"prompt_logprobs": -1})
    assert r.status_code == 400


# --- HTTP priority (vLLM's: lower first, under --scheduling-policy priority) ------------------

def test_http_priority_reaches_the_engine(client, tiny_model_dir, tiny_llm):
    """fcfs (the default) takes only priority 0, as vLLM's engine: the engine's refusal of
    another value names the field; a priority engine serves any int, with the same answer."""
    want = tiny_llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].text
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        assert "priority" in bad(client, path, body | GREEDY | {"priority": 3}, "priority")
        post(client, path, body | GREEDY | {"priority": 0})
    bad(client, "/v1/completions", {"prompt": PROMPT, "priority": "high"} | GREEDY, "priority")
    backend = LocalBackend.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), kv_cache_memory_bytes=8 << 20, scheduling_policy="priority"))
    with TestClient(build_app(backend, "tiny")) as c:
        for priority in (-2, 7):
            out = post(c, "/v1/completions", {"prompt": PROMPT, "priority": priority} | GREEDY)
            assert out["choices"][0]["text"] == want
        beams = post(c, "/v1/completions", {"prompt": PROMPT, "priority": 1, "n": 2,
                                            "use_beam_search": True} | GREEDY)
        assert len(beams["choices"]) == 2
