"""LLM.beam_search on the tiny model against a beam search computed on transformers' logits:
same beams, same scores; width 1 is greedy decoding."""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy, hf_logprobs

from pdserve import BeamSearchParams, SamplingParams
from pdserve.beam_search import BeamSearchSequence, beam_score


def hf_beam_search(model, prompt: list[int], width: int, steps: int, eos: int,
                   length_penalty: float = 1.0) -> list[BeamSearchSequence]:
    """The reference: each live beam's top 2 x width next tokens under transformers' logprobs,
    the best `width` by score survive; EOS-ended beams set aside."""
    live, done = [BeamSearchSequence(list(prompt))], []
    for _ in range(steps):
        grown = []
        for beam in live:
            lp = hf_logprobs(model, beam.tokens)[-1]
            values, ids = lp.topk(2 * width)
            for v, t in zip(values.tolist(), ids.tolist()):
                new = BeamSearchSequence(beam.tokens + [t], cum_logprob=beam.cum_logprob + v)
                (done if t == eos else grown).append(new)
        live = sorted(grown, key=lambda b: beam_score(b, eos, length_penalty),
                      reverse=True)[:width]
    return sorted(done + live, key=lambda b: beam_score(b, eos, length_penalty),
                  reverse=True)[:width]


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 0.5)])
def test_beams_match_a_search_on_transformers_logits(tiny_llm, hf_tiny, width, length_penalty):
    tok = tiny_llm.get_tokenizer()
    prompts = ["The quick brown fox", "Once upon a time there"]
    params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=length_penalty)
    outputs = tiny_llm.beam_search(prompts, params)
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        ids = tok.encode(prompt)
        want = hf_beam_search(hf_tiny, ids, width, 5, tok.eos_token_id, length_penalty)
        assert [b.tokens for b in out.sequences] == [b.tokens for b in want]
        for got, ref in zip(out.sequences, want):
            assert got.cum_logprob == pytest.approx(ref.cum_logprob, abs=1e-3)
            generated = got.tokens[len(ids):]
            assert len(got.logprobs) == len(generated)
            assert got.text == tok.decode(generated[:-1] if got.finish_reason == "stop"
                                          else generated)


def test_width_one_is_greedy(tiny_llm, hf_tiny):
    tok = tiny_llm.get_tokenizer()
    ids = tok.encode("Tell me about the weather")
    [out] = tiny_llm.beam_search({"prompt_token_ids": ids},
                                 BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    assert out.sequences[0].tokens[len(ids):] == hf_greedy(hf_tiny, ids, 6)
    [greedy] = tiny_llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out.sequences[0].text == greedy.outputs[0].text


def test_invalid_beam_search_params(tiny_llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        tiny_llm.beam_search("hi", BeamSearchParams(beam_width=2, max_tokens=10**6))
    with pytest.raises(ValueError, match="params"):
        tiny_llm.beam_search("hi", SamplingParams())
