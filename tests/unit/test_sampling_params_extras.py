"""SamplingParams' truncate_prompt_tokens, logprob_token_ids and flat_logprobs: checks and
the truncation rule. No model."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams


@pytest.mark.parametrize("value", [0, -2, 1.5, "3", True])
def test_truncate_prompt_tokens_rejects_bad_values(value):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=value)


@pytest.mark.parametrize("value", [None, -1, 1, 7])
def test_truncate_prompt_tokens_accepts_vllm_values(value):
    assert SamplingParams(truncate_prompt_tokens=value).truncate_prompt_tokens == value


def test_truncate_prompt_keeps_the_last_tokens():
    ids = list(range(10, 20))
    assert SamplingParams(truncate_prompt_tokens=3).truncate_prompt(ids, 64) == [17, 18, 19]
    assert SamplingParams(truncate_prompt_tokens=1).truncate_prompt(ids, 64) == [19]
    assert SamplingParams(truncate_prompt_tokens=50).truncate_prompt(ids, 64) == ids
    assert SamplingParams().truncate_prompt(ids, 4) == ids  # unset: untouched
    # -1: the model's max length.
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt(ids, 4) == [16, 17, 18, 19]
    with pytest.raises(ValueError, match="truncate_prompt_tokens.*max_model_len=8"):
        SamplingParams(truncate_prompt_tokens=9).truncate_prompt(ids, 8)


@pytest.mark.parametrize("value", [[-1], [1, "2"], 5, [1.0], [True]])
def test_logprob_token_ids_rejects_bad_values(value):
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=value)


def test_logprob_token_ids_deduplicated_and_checked_against_the_vocab():
    params = SamplingParams(logprob_token_ids=(5, 3, 5))
    assert params.logprob_token_ids == [5, 3]
    params.verify_vocab(6)
    with pytest.raises(ValueError, match="logprob_token_ids.*out-of-vocab token id 5"):
        params.verify_vocab(5)


def test_flat_logprobs_is_a_bool():
    assert SamplingParams().flat_logprobs is False
    assert SamplingParams(flat_logprobs=True).flat_logprobs is True
    with pytest.raises(ValueError, match="flat_logprobs"):
        SamplingParams(flat_logprobs="yes")


def test_new_fields_survive_clone():
    params = SamplingParams(truncate_prompt_tokens=4, logprob_token_ids=[1], flat_logprobs=True)
    copy = params.clone()
    assert (copy.truncate_prompt_tokens, copy.logprob_token_ids, copy.flat_logprobs) == (
        4, [1], True)
