"""Outputs where two things meet: prompt logprobs of a prompt preempted in the middle of its
chunked prefill (its chunks are computed again), and a stop string completed by the last
token max_tokens allows."""

import pytest

from pdserve import LLM, SamplingParams

A = "Hello there, this is a short prompt for request A, " * 3
B = "Once upon a time in a land far away there lived a dragon who loved books. " * 5
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny model's block: layers, K/V, 16 tokens, heads


def _run(llm: LLM, prompt_logprobs_params: SamplingParams) -> dict:
    """A decodes; B (with prompt logprobs) arrives after 12 steps and prefills in chunks."""
    engine, outs = llm.llm_engine, {}
    engine.add_request("A", A, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
    for _ in range(12):
        outs.update((o.request_id, o) for o in engine.step())
    engine.add_request("B", B, prompt_logprobs_params)
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    return outs


@pytest.mark.parametrize("n", [1, 2])
def test_prompt_logprobs_survive_preemption_mid_prefill(tiny_model_dir, n):
    sampled = {"temperature": 1.0, "seed": 7} if n > 1 else {"temperature": 0}  # n>1: sampled
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1, n=n, **sampled)
    roomy = LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=32)
    want = _run(roomy, params)["B"]
    tight = LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 * BLOCK_BYTES,
                max_num_batched_tokens=32)
    got = _run(tight, params)["B"]
    assert tight.llm_engine.scheduler.num_preemptions > 0  # B's chunks were computed again
    assert len(got.prompt_logprobs) == len(got.prompt_token_ids) > 64
    assert got.prompt_logprobs[0] is None
    for pos in range(1, len(got.prompt_token_ids)):
        token = got.prompt_token_ids[pos]
        assert token in got.prompt_logprobs[pos], pos  # each position holds its own token
        assert got.prompt_logprobs[pos][token].logprob == \
            pytest.approx(want.prompt_logprobs[pos][token].logprob, abs=1e-4), pos
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    engine = tight.llm_engine
    assert engine.num_free_blocks == engine.num_blocks


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(tiny_model_dir):
    """As vLLM: finish_reason "stop" and the string as stop_reason, the text cut before it."""
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20)
    tokenizer = llm.get_tokenizer()
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for prompt in ("Hello, my name is", "The sky is", "Once upon a time", "1, 2, 3,"):
        [base] = llm.generate(prompt, free, use_tqdm=False)
        text, last = base.outputs[0].text, tokenizer.decode([base.outputs[0].token_ids[-1]])
        stop = last.strip()[:3]
        if stop and text.endswith(last) and stop not in text[:-len(last)]:
            break
    else:
        pytest.skip("no prompt's last token gives a stop string that appears only there")
    for max_tokens in (10, 11):
        [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True, stop=[stop]),
                             use_tqdm=False)
        done = out.outputs[0]
        assert (done.finish_reason, done.stop_reason) == ("stop", stop), max_tokens
        assert done.text == text[:text.index(stop, len(text) - len(last))]
