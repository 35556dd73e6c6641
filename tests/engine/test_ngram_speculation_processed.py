"""N-gram drafts for requests whose logits are processed before a token is chosen: penalties,
biases, masks, min_tokens and structured-output grammars apply to each drafted row as at its
place, so greedy tokens equal an undrafted engine's and constrained outputs always match."""

import json
import re

import jsonschema
import pytest
from test_ngram_speculation import NGRAM, TEXTS, counts

from pdserve import LLM, SamplingParams, StructuredOutputsParams, TokensPrompt


@pytest.fixture(scope="module")
def smollm2_drafting():
    return LLM("SmolLM2-135M-Instruct", kv_cache_memory_bytes=96 << 20, speculative_config=NGRAM)


def test_min_tokens_requests_draft_and_end_where_one_at_a_time_ends(smollm2_drafting,
                                                                   smollm2_llm):
    """Chat replies that end within a few tokens, held to 40 by min_tokens (with a stop
    string met before then): the tokens, text and finish reason of an engine without drafts,
    with drafts kept."""
    chats = [[{"role": "user", "content": "Say hi."}],
             [{"role": "user", "content": "Reply with one word: yes or no."}]]
    params = SamplingParams(temperature=0, max_tokens=60, min_tokens=40, stop=["!"])
    before = counts(smollm2_drafting)
    want = smollm2_llm.chat(chats, params, use_tqdm=False)
    got = smollm2_drafting.chat(chats, params, use_tqdm=False)
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert len(g.token_ids) >= 40
    drafts, _, kept = (a - b for a, b in zip(counts(smollm2_drafting), before))
    assert drafts > 0 and kept > 0


def test_penalized_biased_and_masked_requests_draft_and_keep_their_tokens(smollm2_drafting,
                                                                         smollm2_llm):
    """Greedy SmolLM2 requests with a repetition, presence or frequency penalty, a logit bias,
    bad words or allowed token ids draft, and give the tokens of an engine without drafts:
    each row is checked with the penalties and masks of its place."""
    tok = smollm2_drafting.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    [plain] = smollm2_llm.generate(TokensPrompt(prompt_token_ids=prompts[0]), SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    first = plain.outputs[0].token_ids
    greedy = dict(temperature=0, max_tokens=32, ignore_eos=True)
    cases = [SamplingParams(**greedy, repetition_penalty=1.05),
             SamplingParams(**greedy, presence_penalty=0.3, frequency_penalty=0.2),
             SamplingParams(**greedy, logit_bias={first[3]: -100.0}),
             SamplingParams(**greedy, bad_words=[tok.decode(first[5:7])]),
             SamplingParams(**greedy, allowed_token_ids=sorted(set(sum(prompts, []))))]
    for params in cases:
        before = counts(smollm2_drafting)
        for prompt in prompts:
            [want] = smollm2_llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                          use_tqdm=False)
            [got] = smollm2_drafting.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                              use_tqdm=False)
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, params
        drafts, _, kept = (a - b for a, b in zip(counts(smollm2_drafting), before))
        assert drafts > 0 and kept > 0, params


COLORS = {"type": "array", "minItems": 3, "maxItems": 5, "items": {
    "type": "object", "required": ["color", "count"], "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9}}}}


def test_constrained_requests_draft_and_keep_their_tokens(smollm2_drafting, smollm2_llm):
    """Requests with a JSON schema or a regex draft what their grammar accepts: greedy ones
    give an undrafted engine's tokens, sampled ones always match (jsonschema), with drafts
    kept in both."""
    prompts = ["List colors with counts as JSON: red 1, green 2, blue 3, red 4.",
               "Count the colors red, green, blue, red, green, blue as JSON."]
    regex = r"(red|green|blue)( (red|green|blue)){5,8}\."
    cases = [(StructuredOutputsParams(json=COLORS, disable_any_whitespace=True),
              lambda t: jsonschema.validate(json.loads(t), COLORS)),
             (StructuredOutputsParams(regex=regex), lambda t: re.fullmatch(regex, t) or 1 / 0)]
    for constraint, check in cases:
        greedy = SamplingParams(temperature=0, max_tokens=80, structured_outputs=constraint)
        before = counts(smollm2_drafting)
        want = smollm2_llm.generate(prompts, greedy, use_tqdm=False)
        got = smollm2_drafting.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        for out in got:
            assert out.outputs[0].finish_reason == "stop"
            check(out.outputs[0].text)
        drafts, _, kept = (a - b for a, b in zip(counts(smollm2_drafting), before))
        assert drafts > 0 and kept > 0, constraint
        before = counts(smollm2_drafting)
        sampled = SamplingParams(temperature=0.8, n=4, max_tokens=80,
                                 structured_outputs=constraint)
        for out in smollm2_drafting.generate(prompts, sampled, use_tqdm=False):
            for completion in out.outputs:
                assert completion.finish_reason == "stop", completion.text
                check(completion.text)
        drafts, _, kept = (a - b for a, b in zip(counts(smollm2_drafting), before))
        assert drafts > 0 and kept > 0, constraint
