"""Engine behaviour on the tiny model: prefix cache, preemption, sampling, logprobs, stops."""

import math

import pytest
import torch
from hf_reference import hf_greedy, hf_logprobs

from pdserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = "Once upon a time in a land far away there lived a dragon who loved books. " * 3


def assert_no_block_held(llm):
    engine = llm.llm_engine
    assert engine.num_free_blocks == engine.num_blocks
    assert engine.kv_manager.num_requests == 0
    assert not engine.has_unfinished_requests()


def test_prefix_cache_hit_same_tokens(tiny_llm):
    [first] = tiny_llm.generate(LONG, GREEDY, use_tqdm=False)
    [again] = tiny_llm.generate(LONG, GREEDY, use_tqdm=False)
    n = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // 16 * 16 > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_block_held(tiny_llm)


def test_preemption_under_tiny_kv_budget_keeps_outputs(tiny_model_dir, hf_tiny):
    # 12 blocks of 16 tokens for 6 requests that each need 3-4 blocks: preemption must happen.
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=12 * 16 * 2 * 2 * 2 * 16 * 4,
              enable_prefix_caching=False)
    assert llm.llm_engine.num_blocks == 12
    prompts = [f"Request number {i} asks about " + "cats and dogs " * i for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_tiny, tok.encode(prompt), 30)
    assert_no_block_held(llm)


def test_seeded_sampling_independent_of_batch(tiny_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    [alone] = tiny_llm.generate("Tell me a story", seeded, use_tqdm=False)
    crowd = ["Tell me a story"] * 1 + [f"noise {i}" for i in range(4)]
    params = [seeded] + [SamplingParams(temperature=1.0, max_tokens=7)] * 4
    together = tiny_llm.generate(crowd[::-1], params[::-1], use_tqdm=False)[-1]
    assert together.outputs[0].token_ids == alone.outputs[0].token_ids
    [other_seed] = tiny_llm.generate("Tell me a story", SamplingParams(
        temperature=1.0, top_p=0.9, seed=99, max_tokens=10), use_tqdm=False)
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_greater_than_one(tiny_llm):
    [out] = tiny_llm.generate("Pick a word:", SamplingParams(n=3, temperature=1.0, seed=7,
                                                             max_tokens=8), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    [again] = tiny_llm.generate("Pick a word:", SamplingParams(n=3, temperature=1.0, seed=7,
                                                               max_tokens=8), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_no_block_held(tiny_llm)


def test_stop_strings_and_stop_tokens(tiny_llm):
    [base] = tiny_llm.generate("Hello, my name is", GREEDY, use_tqdm=False)
    text = base.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    [cut] = tiny_llm.generate("Hello, my name is", params, use_tqdm=False)
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]
    params.include_stop_str_in_output = True
    [kept] = tiny_llm.generate("Hello, my name is", params, use_tqdm=False)
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    third = base.outputs[0].token_ids[2]
    [tok_stop] = tiny_llm.generate("Hello, my name is", SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[third]), use_tqdm=False)
    assert tok_stop.outputs[0].token_ids == base.outputs[0].token_ids[:3]
    assert tok_stop.outputs[0].stop_reason == third
    assert_no_block_held(tiny_llm)


def test_logprobs_match_reference_log_softmax(tiny_llm, hf_tiny):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    [out] = tiny_llm.generate("The meaning of life is", params, use_tqdm=False)
    c = out.outputs[0]
    ref = hf_logprobs(hf_tiny, out.prompt_token_ids + c.token_ids)
    P = len(out.prompt_token_ids)
    total = 0.0
    for i, (tid, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[P - 1 + i]
        assert tid in entry and len(entry) >= 3
        for t, lp in entry.items():
            assert math.isclose(lp.logprob, row[t].item(), abs_tol=1e-4)
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(entry)
        assert entry[top[0]].rank == 1
        total += entry[tid].logprob
    assert math.isclose(c.cumulative_logprob, total, abs_tol=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == P
    for pos in range(1, P):
        tid = out.prompt_token_ids[pos]
        assert math.isclose(out.prompt_logprobs[pos][tid].logprob, ref[pos - 1, tid].item(),
                            abs_tol=1e-4)


def test_sampling_knobs_change_output_as_expected(tiny_llm):
    [base] = tiny_llm.generate("A B C", GREEDY, use_tqdm=False)
    first = base.outputs[0].token_ids[0]
    [biased] = tiny_llm.generate("A B C", SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, logit_bias={42: 100.0}), use_tqdm=False)
    assert biased.outputs[0].token_ids == [42, 42, 42]
    [allowed] = tiny_llm.generate("A B C", SamplingParams(
        temperature=0.8, seed=0, max_tokens=5, allowed_token_ids=[10, 11]), use_tqdm=False)
    assert set(allowed.outputs[0].token_ids) <= {10, 11}
    # The n sequences of one request share its mask and bias tensors, built once.
    engine = tiny_llm.llm_engine
    engine.add_request("shared", "A B C", SamplingParams(
        n=3, temperature=0.8, seed=1, max_tokens=4, allowed_token_ids=[10, 11, 12],
        logit_bias={12: 2.0}))
    children = [r for r in engine.scheduler.requests.values() if r.request_id.endswith("shared")]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert len(children) == 3 and len({id(c.constant_logits_cache) for c in children}) == 1
    assert len(children[0].constant_logits_cache) == 1
    assert {t for o in outputs for c in o.outputs for t in c.token_ids} <= {10, 11, 12}
    word = tiny_llm.get_tokenizer().decode([first])
    [banned] = tiny_llm.generate("A B C", SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, bad_words=[word.strip()]),
        use_tqdm=False)
    assert banned.outputs[0].token_ids[0] != first
    [rep] = tiny_llm.generate("A B C", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=5.0), use_tqdm=False)
    assert len(set(rep.outputs[0].token_ids)) == 12


def test_min_tokens_and_eos(tiny_llm):
    eos = tiny_llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=4, logit_bias={eos: 50.0})
    [out] = tiny_llm.generate("Stop now", params, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.token_ids) == 5 and c.token_ids[-1] == eos and eos not in c.token_ids[:4]
    assert c.finish_reason == "stop" and c.stop_reason is None


def test_llm_engine_step_api_and_abort(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.add_request("keep", "Hello there", SamplingParams(temperature=0, max_tokens=5,
                                                             ignore_eos=True))
    engine.add_request("drop", "Goodbye now", SamplingParams(max_tokens=500, ignore_eos=True))
    seen = []
    engine.step()
    engine.abort_request("drop")
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    keep = [o for o in seen if o.request_id == "keep"]
    assert keep[-1].finished and len(keep[-1].outputs[0].token_ids) == 5
    assert all(o.request_id != "drop" for o in seen)
    # CUMULATIVE outputs grow one token per step.
    assert [len(o.outputs[0].token_ids) for o in keep] == list(range(1, 6))[-len(keep):]
    assert_no_block_held(tiny_llm)


@pytest.mark.parametrize("first, second", [(("x", 2), ("0_x", 1)), (("0_x", 1), ("x", 2)),
                                           (("y", 2), ("1_y", 3))])
def test_a_request_id_naming_another_requests_sequence_is_refused(tiny_llm, first, second):
    """n > 1 names its sequences "{i}_{id}"; an id that clashes with one of them (either way
    round) is refused, and the request already queued finishes as if alone."""
    engine = tiny_llm.llm_engine
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True)
    engine.add_request(first[0], "Hello there", _with_n(params, first[1]))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(second[0], "Hello there", _with_n(params, second[1]))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert list(done) == [first[0]]
    assert [len(c.token_ids) for c in done[first[0]].outputs] == [4] * first[1]
    [alone] = tiny_llm.generate("Hello there", _with_n(params, first[1]), use_tqdm=False)
    assert [c.token_ids for c in done[first[0]].outputs] == [c.token_ids for c in alone.outputs]
    assert_no_block_held(tiny_llm)


def _with_n(params: SamplingParams, n: int) -> SamplingParams:
    out = params.clone()
    out.n = n
    return out


def test_chat_uses_template(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hi!"}]
    [out] = tiny_llm.chat(messages, GREEDY, use_tqdm=False)
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert "<|im_start|>assistant" in tok.decode(out.prompt_token_ids)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"seed": 1 << 63}, "seed"),  # a generator's seed is 64 bits (the wire's int64)
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_are_value_errors_and_leave_nothing_behind(tiny_llm):
    vocab = tiny_llm.llm_engine.config.model.arch.vocab_size
    cases = [
        ("", SamplingParams(), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": [vocab + 5]}, SamplingParams(), "prompt_token_ids"),
        ("word " * 3000, SamplingParams(), "max_model_len"),
        ("ok", SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
        ("ok", SamplingParams(allowed_token_ids=[vocab + 1]), "allowed_token_ids"),
        ("ok", SamplingParams(logprob_token_ids=list(range(21))), "logprob_token_ids"),
        (12, SamplingParams(), "prompt"),
    ]
    for prompt, params, field in cases:
        with pytest.raises(ValueError, match=field):
            tiny_llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        tiny_llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert_no_block_held(tiny_llm)
    assert tiny_llm.llm_engine.get_num_unfinished_requests() == 0


def test_bad_models_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], '
                                          '"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_logprob_token_ids_adds_those_tokens_logprobs(tiny_llm, hf_tiny):
    """Each position also gets the logprobs of the ids asked for, with their ranks, under the
    raw logits (checked against transformers)."""
    tok = tiny_llm.get_tokenizer()
    ids = tok.encode("The weather today is")
    watch = [5, 17, 300]
    [out] = tiny_llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, logprob_token_ids=watch),
        use_tqdm=False)
    c = out.outputs[0]
    ref = hf_logprobs(hf_tiny, ids + c.token_ids)
    for pos, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert set(entry) == {token, *watch}
        row = ref[len(ids) - 1 + pos]
        for t in watch:
            assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
            assert entry[t].rank == int((row >= row[t]).sum())
