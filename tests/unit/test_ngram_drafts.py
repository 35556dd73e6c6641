"""Prompt-lookup drafts (engine/ngram_drafts.py): what is proposed, the back-off, and vLLM's
speculative_config as pdserve reads it."""

import pytest
from structured_fixtures import toy_grammar

from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.ngram_drafts import (NgramDrafts, SpeculativeConfig, propose_drafts,
                                         speculates)
from pdserve.engine.request import Request
from pdserve.pooling_params import PoolingParams
from pdserve.sampling_params import SamplingParams


def drafts(k=3, lo=2, hi=4):
    return NgramDrafts(SpeculativeConfig(k, lo, hi))


def test_the_tokens_after_the_latest_earlier_occurrence_of_the_longest_suffix():
    # suffix [3, 4] occurs at 2-3 (followed by 9, 9, 9) and at 6-7 (followed by 5, 6, 3)
    tokens = [1, 2, 3, 4, 9, 9, 3, 4, 5, 6, 3, 4]
    assert drafts().propose(tokens, 8) == [5, 6, 3]
    # the longest suffix wins: [7, 3, 4] occurs once, after which comes 8
    tokens = [7, 3, 4, 8, 0, 3, 4, 1, 7, 3, 4]
    assert drafts().propose(tokens, 8) == [8, 0, 3]


def test_limits_the_index_catching_up_and_nothing_found():
    d = drafts(k=4)
    seq = [5, 6, 7, 5, 6]
    assert d.propose(seq, 2) == [7, 5]  # at most `limit`
    assert d.propose(seq, 0) == []
    seq += [1, 2]  # the index catches up with the new tokens: [1, 2] never occurred before
    assert d.propose(seq, 4) == []
    seq += [5, 6]  # [2, 5, 6] never occurred before; [5, 6] last did at 3-4
    assert d.propose(seq, 4) == [1, 2, 5, 6]
    assert drafts(lo=3, hi=3).propose([5, 6, 7, 5, 6], 4) == []  # no 3-gram repeats
    assert drafts(lo=1, hi=1).propose([9, 8, 9], 4) == [8, 9, 8]  # period 2 (below)


def test_rejections_back_off_exponentially_and_an_acceptance_resets():
    d = drafts()
    seq = [1, 2, 3, 1, 2]
    assert d.propose(seq, 3)
    d.record(3, 0)  # rejected outright: skip one step
    assert d.propose(seq, 3) == []
    assert d.propose(seq, 3)
    d.record(3, 0)  # again: skip two
    assert d.propose(seq, 3) == [] and d.propose(seq, 3) == []
    assert d.propose(seq, 3)
    d.record(3, 1)  # one accepted: no skipping, and the next rejection skips one again
    assert d.propose(seq, 3)
    d.record(3, 0)
    assert d.propose(seq, 3) == []
    assert d.propose(seq, 3)


@pytest.mark.parametrize("value,want", [
    ({"method": "ngram"}, SpeculativeConfig(3, 5, 5)),  # vLLM's bounds when none is given
    ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6}',
     SpeculativeConfig(5, 6, 6)),  # one bound: the other equals it, as in vLLM
    ({"method": "ngram", "prompt_lookup_min": 2}, SpeculativeConfig(3, 2, 2)),
    ({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
      "prompt_lookup_max": 3}, SpeculativeConfig(2, 1, 3)),  # vLLM's older spelling
    (None, None), ({}, None), ("{}", None),
])
def test_vllm_speculative_config(value, want):
    assert SpeculativeConfig.from_vllm(value) == want


@pytest.mark.parametrize("value,field", [
    ({"method": "eagle", "model": "x"}, "method"),
    ({"method": "ngram", "model": "x"}, "model"),
    ({"prompt_lookup_max": 4}, "method None"),
    ({"method": "ngram", "disable_by_batch_size": 4}, "unsupported key"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_max": True}, "prompt_lookup_max"),
    ("{not json", "not JSON"),
    ([1, 2], "must be a dict"),
])
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_vllm(value)


def test_every_generating_request_speculates():
    def request(**kw):
        return Request("r", [1, 2, 3], SamplingParams(**kw))

    assert speculates(request(temperature=0))
    assert speculates(request(temperature=0.7, seed=3))  # each row draws its place's draw
    assert speculates(request(temperature=0, stop=["x"]))  # cut where it ends (processor)
    assert speculates(request(temperature=0, seed=3))
    assert speculates(request(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05))
    assert speculates(request(temperature=0.7, logprobs=2))  # the rows' logprobs
    assert speculates(request(temperature=0, logprobs=2, prompt_logprobs=1))
    for kw in ({"logit_bias": {5: 1.0}}, {"repetition_penalty": 1.2},
               {"presence_penalty": 0.5}, {"allowed_token_ids": [1, 2]}):
        assert speculates(request(temperature=0, **kw))  # rows checked as processed
    assert speculates(request(temperature=0, min_tokens=4))  # rows forbid the stop tokens
    pooled = request(temperature=0)
    pooled.pooling_params = PoolingParams()
    assert not speculates(pooled)


def test_command_line_flag(tiny_model_dir):
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tiny_model_dir), "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2}'])
    engine_args = EngineArgs(**{f: getattr(args, f) for f in vars(args)})
    assert engine_args.create_engine_config().scheduler.speculative == SpeculativeConfig(2, 5, 5)
    assert parser.parse_args(["-sc", '{"method": "ngram"}']).speculative_config == {
        "method": "ngram"}  # vLLM's short flag
    bad = EngineArgs(model=str(tiny_model_dir), speculative_config={"method": "medusa"})
    with pytest.raises(ValueError, match="speculative_config.method"):
        bad.create_engine_config()


def test_a_short_period_repeats():
    """The latest occurrence of a loop's suffix is one period back: the drafts continue the
    loop instead of stopping at the sequence's end."""
    assert drafts(k=5).propose([4, 9, 9, 9], 5) == [9, 9, 9, 9, 9]
    assert drafts(k=5).propose([1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]


def test_a_constrained_request_drafts_only_what_its_grammar_accepts():
    """The sequence a b c a b proposes c a b; each grammar keeps the drafts it accepts from
    where the output stands, in order, and none past its end."""
    config = SpeculativeConfig(3, 1, 2)
    for regex, want in (("cab", [2, 0, 1]), ("ca", [2, 0]), ("c", [2]), ("c*x", [2]),
                        ("x", None)):
        request = Request("r", [0, 1, 2, 0, 1], SamplingParams(temperature=0, max_tokens=9))
        request.num_computed_tokens = 4  # decoding: the last token is next to compute
        request.grammar = toy_grammar(regex)
        assert propose_drafts([request], config, 64).get("r") == want, regex
        assert request.grammar.accepted_prefix([2, 0, 1]) == len(want or []), regex
