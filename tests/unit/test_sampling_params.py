import pytest

from pdserve.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == [] and p.ignore_eos is False
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert p.include_stop_str_in_output is False
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words is None
    assert p.output_kind is RequestOutputKind.CUMULATIVE and p.extra_args is None
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_normalisation():
    p = SamplingParams(stop="###", top_k=-1, stop_token_ids=(5, 7), temperature=1,
                       logit_bias={"12": 3, 4: -1.5}, output_kind=1, max_tokens=None)
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.stop_token_ids == [5, 7] and p.all_stop_token_ids == {5, 7}
    assert isinstance(p.temperature, float)
    assert p.logit_bias == {12: 3.0, 4: -1.5}
    assert p.output_kind is RequestOutputKind.DELTA
    assert p.max_tokens is None


def test_greedy_resets_filters_and_type():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_tiny_positive_temperature_is_raised_not_greedy():
    p = SamplingParams(temperature=1e-7)
    assert p.temperature == pytest.approx(0.01)
    assert not p.is_greedy


@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        ({"n": 0}, "n", "0"),
        ({"n": 1.5}, "n", "1.5"),
        ({"temperature": -1.0}, "temperature", "-1.0"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"top_k": 2.5}, "top_k", "2.5"),
        ({"min_p": -0.1}, "min_p", "-0.1"),
        ({"min_p": 1.1}, "min_p", "1.1"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
        ({"presence_penalty": -2.1}, "presence_penalty", "-2.1"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "-3.0"),
        ({"frequency_penalty": 2.01}, "frequency_penalty", "2.01"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "-1.0"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty", "1e-300"),  # 0 in float32
        ({"repetition_penalty": 1e39}, "repetition_penalty", "1e+39"),  # inf in float32
        ({"logit_bias": {3: 1e39}}, "logit_bias", "1e+39"),
        ({"logit_bias": {3: -1e308}}, "logit_bias", "-1e+308"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "20"),
        ({"logprobs": -2}, "logprobs", "-2"),
        ({"prompt_logprobs": -5}, "prompt_logprobs", "-5"),
        ({"stop": ["ok", ""]}, "stop", "''"),
        ({"stop": ["ok", 3]}, "stop", "3"),
        ({"stop_token_ids": [1, -4]}, "stop_token_ids", "-4"),
        ({"stop_token_ids": [1, "x"]}, "stop_token_ids", "'x'"),
        ({"seed": "abc"}, "seed", "'abc'"),
        ({"seed": 1.5}, "seed", "1.5"),
        ({"bad_words": "word"}, "bad_words", "'word'"),
        ({"bad_words": ["ok", 7]}, "bad_words", "7"),
        ({"stop": ["x"], "detokenize": False}, "detokenize", "'x'"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias", "'abc'"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias", "-3"),
        ({"logit_bias": {3: "big"}}, "logit_bias", "'big'"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "[]"),
        ({"allowed_token_ids": [2, -1]}, "allowed_token_ids", "-1"),
        ({"output_kind": 7}, "output_kind", "7"),
        ({"temperature": "hot"}, "temperature", "'hot'"),
        ({"n": 2, "temperature": 0.0}, "n", "2"),
    ],
)
def test_invalid_values_raise_naming_field_and_value(kwargs, field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert field in message
    assert value in message


def test_boundary_values_are_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=2.0, frequency_penalty=-2.0,
                   logprobs=-1, prompt_logprobs=0, top_k=-1, min_tokens=16, max_tokens=16)
    SamplingParams(logprobs=0, prompt_logprobs=-1, temperature=0.0)
    SamplingParams(repetition_penalty=1e-40, logit_bias={3: -3e38}, top_p=1e-300)


def test_verify_vocab():
    ok = SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[0, 9], stop_token_ids=[9])
    ok.verify_vocab(10)
    for kwargs, field in [({"logit_bias": {10: 1.0}}, "logit_bias"),
                          ({"allowed_token_ids": [3, 10]}, "allowed_token_ids"),
                          ({"stop_token_ids": [10]}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=f"{field}.*10"):
            SamplingParams(**kwargs).verify_vocab(10)
    p = SamplingParams(allowed_token_ids=[1])
    p.allowed_token_ids = []
    with pytest.raises(ValueError, match="allowed_token_ids"):
        p.verify_vocab(10)


def test_clone_is_deep_and_mutable():
    p = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[1] = 5.0
    q.temperature = 0.5
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0} and p.temperature == 1.0


def test_output_text_buffer_length():
    assert SamplingParams(stop=["ab", "wxyz"]).output_text_buffer_length == 3
    included = SamplingParams(stop=["ab"], include_stop_str_in_output=True)
    assert included.output_text_buffer_length == 0
    assert SamplingParams().output_text_buffer_length == 0


_NON_FINITE = [float("nan"), float("inf"), float("-inf")]
_FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"]


@pytest.mark.parametrize("field", _FLOAT_FIELDS)
@pytest.mark.parametrize("value", _NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_values_are_rejected_naming_the_field(field, value):
    # GHSA-7h4p-rffg-7823: NaN slipped past every range check (all comparisons are False)
    # and sampled token 0 forever; an inf temperature flattened the logits to NaN.
    with pytest.raises(ValueError, match=f"^{field} must be a finite number, got {value!r}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", _NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_logit_bias_is_rejected(value):
    with pytest.raises(ValueError, match=f"^logit_bias values must be finite.*{value!r}.*7"):
        SamplingParams(logit_bias={7: 1.0, "7": value})
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={"3": value})


def test_verify_max_logprobs():
    SamplingParams(logprobs=20, prompt_logprobs=20).verify_max_logprobs(20, 100)
    SamplingParams(logprobs=-1).verify_max_logprobs(-1, 100)  # -1: no cap
    SamplingParams(logprobs=-1).verify_max_logprobs(100, 100)  # whole vocab fits
    for kwargs, field in [({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": 21},
                                                            "prompt_logprobs"),
                          ({"logprobs": -1}, "logprobs")]:
        with pytest.raises(ValueError, match=f"^{field}: .* more than max_logprobs=20"):
            SamplingParams(**kwargs).verify_max_logprobs(20, 100)
