"""Request parsing, SamplingParams mapping and the two logprobs formats of the gateway."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from pdserve.gateway.backend import TokenLogprob
from pdserve.gateway.guards import Admission
from pdserve.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    param_of,
)
from pdserve.gateway.serving import CompletionLogprobs, chat_logprobs


class Decoder:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


CTX = type("Ctx", (), {"decode": staticmethod(Decoder().decode)})()


@pytest.mark.parametrize("prompt, want", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2], [[1, 2]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompts(prompt, want):
    assert CompletionRequest(prompt=prompt).prompts() == want


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_empty_prompts_rejected(prompt):
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt=prompt).prompts()
    assert e.value.param == "prompt"


def test_mixed_prompt_list_rejected():
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=["a", [1]])


def test_defaults_follow_openai_and_vllm():
    p = CompletionRequest(prompt="x").sampling_params(16)
    assert (p.max_tokens, p.temperature, p.n, p.logprobs, p.top_k) == (16, 1.0, 1, None, 0)
    assert CompletionRequest(prompt="x").max_tokens == 16  # completions default
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]) \
        .requested_max_tokens is None  # chat: the rest of the context


def test_echo_logprobs_asks_prompt_logprobs():
    p = CompletionRequest(prompt="x", echo=True, logprobs=2).sampling_params(4)
    assert p.prompt_logprobs == 2 and p.logprobs == 2


def test_chat_logprobs_mapping():
    msgs = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(messages=msgs).sampling_params(4).logprobs is None
    assert ChatCompletionRequest(messages=msgs, logprobs=True).sampling_params(4).logprobs == 0
    assert ChatCompletionRequest(messages=msgs, logprobs=True, top_logprobs=5) \
        .sampling_params(4).logprobs == 5
    with pytest.raises(APIError) as e:
        ChatCompletionRequest(messages=msgs, top_logprobs=5).sampling_params(4)
    assert e.value.param == "top_logprobs"


def test_sampling_errors_name_the_field():
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt="x", temperature=0, n=2).sampling_params(4)
    assert e.value.status == 400 and e.value.param == "n"


def test_logit_bias_is_clamped_to_the_openai_range():
    """OpenAI's range is [-100, 100] (vLLM clamps likewise): 1e308 would overflow float32."""
    bias = {"1": 1e308, "2": -1e308, "3": 2.5}
    p = CompletionRequest(prompt="x", logit_bias=bias).sampling_params(4)
    assert p.logit_bias == {1: 100.0, 2: -100.0, 3: 2.5}


@pytest.mark.parametrize("message, param", [
    ("temperature must be non-negative, got -1", "temperature"),
    ("prompt_token_ids: token id 5 is outside", "prompt"),
    ("max_tokens: too many", "max_tokens"),
    ("something else broke", None),
])
def test_param_of(message, param):
    assert param_of(message) == param


def test_completion_logprobs_topk_plus_sampled_and_offsets():
    sampled_low = [TokenLogprob(7, -3.0, 4, "s"), TokenLogprob(1, -0.1, 1, "a"),
                   TokenLogprob(2, -0.2, 2, "b")]
    fmt = CompletionLogprobs(CTX, k=2, offset=5)
    out = fmt.format([sampled_low, None], [7, 9])
    assert out["tokens"] == ["s", "<9>"]
    assert out["token_logprobs"] == [-3.0, None]
    assert out["top_logprobs"] == [{"a": -0.1, "b": -0.2, "s": -3.0}, None]
    assert out["text_offset"] == [5, 6]
    assert fmt.offset == 9


def test_chat_logprobs_topk_only_and_clamped():
    pos = [TokenLogprob(7, -math.inf, 3, "é"), TokenLogprob(1, -0.1, 1, "a"),
           TokenLogprob(2, -0.2, 2, "b")]
    out = chat_logprobs(CTX, [pos], [7], k=2)["content"][0]
    assert out["token"] == "é" and out["logprob"] == -9999.0
    assert out["bytes"] == list("é".encode())
    assert [t["token"] for t in out["top_logprobs"]] == ["a", "b"]


def test_admission_bounds_in_flight():
    a = Admission(2)
    a.enter()
    a.enter()
    with pytest.raises(APIError) as e:
        a.enter()
    assert e.value.status == 429
    a.leave()
    a.enter()
    with pytest.raises(ValueError):
        Admission(0)
