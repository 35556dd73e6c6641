"""Speculative decoding by prompt lookup (engine/ngram_drafts.py): the tokens are those of
greedy decoding one token at a time (transformers' generate), through the native layer loop
and the module path, with drafts both kept and refused, under preemption, with stop tokens
and when streaming."""

import pytest
import torch
from hf_reference import hf_greedy
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams, TokensPrompt
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import RequestOutputKind

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
TEXTS = ["Count: one, two, three, one, two, three, one, two,",
         "The rule is simple. The rule is simple. The rule",
         "Write a list of colors: red, green, blue, red, green,"]


def assert_greedy_like_transformers(llm, hf, prompts, n):
    """`n` greedy tokens of each token prompt from `llm` equal transformers' generate."""
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, n)


def counts(llm):
    s = llm.llm_engine.scheduler
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


@pytest.fixture(scope="module")
def smollm2_drafting():
    return LLM("SmolLM2-135M-Instruct", kv_cache_memory_bytes=96 << 20, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def copying_model(copying_model_dir):
    """The copying model's directory (conftest.py) and its transformers reference."""
    model = AutoModelForCausalLM.from_pretrained(copying_model_dir, dtype=torch.float32)
    return copying_model_dir, model.eval()


def test_native_loop_drafts_give_transformers_tokens(smollm2_drafting, hf_smollm2):
    """SmolLM2 through the native loop: some drafts are kept and some refused, and every
    output is transformers' greedy output; a stop token inside kept drafts ends the output
    there, as without drafts."""
    llm = smollm2_drafting
    assert llm.llm_engine.runner.model.native_layers is not None
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    want = [hf_greedy(hf_smollm2, p, 40) for p in prompts]
    before = counts(llm)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    drafts, drafted, kept = (a - b for a, b in zip(counts(llm), before))
    assert drafts > 0 and 0 < kept < drafted  # both outcomes were exercised
    # a stop token first met after a few tokens: the output ends with it (then "stop")
    i, j = next((i, j) for i, w in enumerate(want) for j in range(4, 40)
                if w.index(w[j]) == j)
    stop = want[i][j]
    generated = llm.llm_engine.num_generation_tokens
    [out] = llm.generate(TokensPrompt(prompt_token_ids=prompts[i]),
                         SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]),
                         use_tqdm=False)
    assert list(out.outputs[0].token_ids) == want[i][:j + 1]
    # kept drafts after the stop token are neither output nor counted
    assert llm.llm_engine.num_generation_tokens - generated == j + 1
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_stop_strings_inside_kept_drafts_end_the_output_there(smollm2_drafting, smollm2_llm):
    """Stop strings taken from the middle of greedy outputs: with drafts, the tokens, text,
    finish and stop reasons equal those of an engine without drafts; tokens kept past the
    stop string in the same step are dropped (at least one case has some) and not counted as
    generated."""
    tok = smollm2_drafting.get_tokenizer()
    scheduler = smollm2_drafting.llm_engine.scheduler
    dropped = []
    for prompt in (tok.encode(t) for t in TEXTS):
        [whole] = smollm2_llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        text = whole.outputs[0].text
        for at, include in ((len(text) // 3, False), (len(text) // 2, True)):
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                    stop=[text[at:at + 3]], include_stop_str_in_output=include)
            [want] = smollm2_llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                          use_tqdm=False)
            before = scheduler.num_output_tokens
            generated = smollm2_drafting.llm_engine.num_generation_tokens
            [got] = smollm2_drafting.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                              use_tqdm=False)
            g, w = got.outputs[0], want.outputs[0]
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
                w.token_ids, w.text, w.finish_reason, w.stop_reason) and g.finish_reason == "stop"
            dropped.append(scheduler.num_output_tokens - before - len(g.token_ids))
            # the generated-token counter counts the tokens output, not those dropped
            assert (smollm2_drafting.llm_engine.num_generation_tokens - generated
                    == len(g.token_ids))
    assert max(dropped) > 0 and min(dropped) >= 0


def test_streamed_deltas_carry_the_kept_drafts(smollm2_drafting):
    engine: LLMEngine = smollm2_drafting.llm_engine
    tok = smollm2_drafting.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("s", TokensPrompt(prompt_token_ids=tok.encode(TEXTS[1])), params)
    deltas, texts = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(list(out.outputs[0].token_ids))
            texts.append(out.outputs[0].text)
    [whole] = smollm2_drafting.generate(TEXTS[1], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert sum(deltas, []) == list(whole.outputs[0].token_ids)
    assert "".join(texts) == whole.outputs[0].text
    assert max(map(len, deltas)) > 1  # some step gave several tokens


def test_module_path_keeps_every_right_draft(copying_model):
    path, hf = copying_model
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, speculative_config=NGRAM)
    assert llm.llm_engine.runner.model.native_layers is None  # head size 16: module path
    assert_greedy_like_transformers(llm, hf, [[5, 6, 7, 8, 9] * 3, list(range(100, 131))], 24)
    drafts, drafted, kept = counts(llm)
    assert drafts > 0 and kept == drafted
    assert drafts <= 2 * 24 / 4 + 2  # each step after the first two gave 1 + 3 tokens


def test_module_path_refused_drafts_leave_no_trace(copying_model):
    """The copying model repeats its prompt's last token, and [5, 5] was once followed by
    6, 7, 5: that draft is refused, and its keys and values never reach an output; the
    drafts of the loop after it are kept."""
    path, hf = copying_model
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20,
              speculative_config={**NGRAM, "prompt_lookup_min": 2})
    assert_greedy_like_transformers(llm, hf, [[5, 5, 6, 7, 5], [11, 11, 12, 13, 14, 11]], 20)
    _, drafted, kept = counts(llm)
    assert 0 < kept <= drafted - 2 * 3  # each sequence's first draft was refused outright


def test_preemption_with_drafts_keeps_outputs(copying_model):
    path, hf = copying_model
    # 10 blocks of 16 tokens; 5 requests of 40-token prompts and 24 outputs need 4-5 each
    llm = LLM(str(path), kv_cache_memory_bytes=10 * 16 * 2 * 2 * 2 * 16 * 4,
              enable_prefix_caching=False, speculative_config=NGRAM)
    assert llm.llm_engine.num_blocks == 10
    prompts = [[(17 * i + 5 * j) % 5000 + 10 for j in range(40)] for i in range(5)]
    assert_greedy_like_transformers(llm, hf, prompts, 24)
    assert llm.llm_engine.scheduler.num_preemptions > 0 and counts(llm)[2] > 0
    engine = llm.llm_engine
    assert engine.num_free_blocks == engine.num_blocks and engine.kv_manager.num_requests == 0


def test_seeded_requests_draft_and_draw_what_one_at_a_time_draws(copying_model):
    """Seeded sampled requests draft, keep some drafts and refuse others, and give the tokens
    of an engine without drafts."""
    path, _ = copying_model
    prompt = TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9] * 3)
    seeded = [SamplingParams(temperature=2.0, top_k=3, seed=seed, max_tokens=24,
                             ignore_eos=True) for seed in range(8)]
    results = []
    for spec in (None, NGRAM):
        llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, speculative_config=spec)
        outs = llm.generate([prompt] * 8, seeded, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        drafts, drafted, kept = counts(llm)
        assert (drafts == 0) if spec is None else (0 < kept < drafted)
    assert results[0] == results[1]
    assert len(set(map(tuple, results[0]))) > 1  # the seeds draw differently


def assert_same_logprobs(got, want):
    """Tokens, finish, logprobs (within float noise), ranks and prompt logprobs alike."""
    g, w = got.outputs[0], want.outputs[0]
    assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert len(g.logprobs) == len(g.token_ids)
    pairs = list(zip(g.logprobs, w.logprobs)) + list(zip(got.prompt_logprobs or [],
                                                         want.prompt_logprobs or []))
    for a, b in pairs:
        assert (a is None) == (b is None)
        if a is not None:
            assert {t: e.rank for t, e in a.items()} == {t: e.rank for t, e in b.items()}
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)


def test_logprobs_requests_draft_and_get_one_token_at_a_times_logprobs(smollm2_drafting,
                                                                        smollm2_llm):
    """Greedy requests asking for logprobs (with prompt logprobs, or with a stop string that
    kept drafts run past) draft on SmolLM2, drafts kept and refused, and get what an engine
    without drafts gives: tokens, text, a logprob entry per token with the same ranks and
    values, the same cumulative logprob."""
    tok = smollm2_drafting.get_tokenizer()
    before = counts(smollm2_drafting)
    for prompt in (tok.encode(t) for t in TEXTS):
        [whole] = smollm2_llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        text = whole.outputs[0].text
        for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                      logprobs=3, prompt_logprobs=2),
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                      logprobs=1, stop=[text[len(text) // 2:][:3]])):
            [want] = smollm2_llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                          use_tqdm=False)
            [got] = smollm2_drafting.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                              use_tqdm=False)
            assert_same_logprobs(got, want)
    drafts, drafted, kept = (a - b for a, b in zip(counts(smollm2_drafting), before))
    assert drafts > 0 and 0 < kept < drafted


def test_sampled_requests_with_logprobs_draft_and_report_the_models_logprobs(copying_model):
    """An unseeded sampled request with logprobs keeps drafts, and each output token's entry
    holds transformers' log-softmax at its position for it and for the two likeliest tokens;
    the cumulative logprob is their sum."""
    path, hf = copying_model
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, speculative_config=NGRAM)
    prompt = [5, 6, 7, 8, 9] * 3
    [out] = llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(
        temperature=0.8, max_tokens=16, logprobs=2, ignore_eos=True), use_tqdm=False)
    assert counts(llm)[2] > 0
    tokens, entries = list(out.outputs[0].token_ids), out.outputs[0].logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0], dim=-1)  # (T, V)
    assert len(entries) == len(tokens) == 16
    total = 0.0
    for i, (token, entry) in enumerate(zip(tokens, entries)):
        row = ref[len(prompt) - 1 + i]  # (V,) the distribution this token was drawn from
        top = row.topk(2)
        assert set(top.indices.tolist()) | {token} == set(entry)
        for t in entry:
            assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
        total += row[token].item()
    assert out.outputs[0].cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_drafts_stay_in_the_step_budget_and_never_crowd_out_a_decode(copying_model):
    """With 12 tokens a step and 5 requests decoding, every decoding request gets its token
    each step; drafts only fill what is left (7 of the 12), never more."""
    path, hf = copying_model
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=12,
              speculative_config=NGRAM)
    engine = llm.llm_engine
    execute, steps = engine.runner.execute, []

    def record(sched):
        decoding = {r.request_id for r in engine.scheduler.running
                    if r.num_tokens - r.num_computed_tokens == 1}
        steps.append((sched.num_tokens, decoding, {c.request.request_id for c in sched.chunks},
                      sum(len(c.draft_token_ids) for c in sched.chunks)))
        return execute(sched)

    engine.runner.execute = record
    assert_greedy_like_transformers(llm, hf, [[40 + i, 41 + i] for i in range(5)], 16)
    assert all(tokens <= 12 for tokens, *_ in steps)
    assert all(decoding <= chunked for _, decoding, chunked, _ in steps)
    assert any(len(decoding) == 5 and drafts == 7 for _, decoding, _, drafts in steps)


def test_draft_counters_in_get_metrics_and_on_metrics(copying_model):
    """vLLM's spec_decode counters: in `LLM.get_metrics()` and on the gateway's /metrics of a
    local engine with drafts, equal to the engine's own counts; absent without drafts."""
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from pdserve.engine.engine_args import EngineArgs
    from pdserve.gateway.app import build_app
    from pdserve.gateway.local_backend import LocalBackend

    path, _ = copying_model
    names = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens")
    backend = LocalBackend.from_engine_args(EngineArgs(
        model=str(path), kv_cache_memory_bytes=8 << 20, served_model_name="copy",
        speculative_config=NGRAM))
    with TestClient(build_app(backend, "copy")) as client:
        r = client.post("/v1/completions", json={"prompt": [5, 6, 7, 5, 6], "max_tokens": 16,
                                                  "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        samples = {s.name: s.value for f in text_string_to_metric_families(
            client.get("/metrics").text) for s in f.samples}
    s = backend.engine.scheduler
    want = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
    assert want[0] > 0
    assert tuple(samples[f"pdserve:{n}_total"] for n in names) == want
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, speculative_config=NGRAM)
    llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7, 5, 6]), SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    got = {m.name: m.value for m in llm.get_metrics()}
    assert tuple(got[f"vllm:{n}"] for n in names) == counts(llm) and counts(llm)[0] > 0
    plain = LLM(str(path), kv_cache_memory_bytes=8 << 20)
    assert not any(m.name.startswith("vllm:spec_decode") for m in plain.get_metrics())


def test_sampled_requests_draft_and_follow_transformers_distribution(copying_model):
    """Unseeded sampled requests draft too (rejection sampling, draft_verifier.py): drafts are
    kept and refused, and the tokens that follow a state follow transformers' distribution
    there at temperature 2 and top_k 3 (the copying model's next token depends on the last
    token alone, so every transition out of the state is one draw from it)."""
    path, hf = copying_model
    with torch.no_grad():
        logits = hf(torch.arange(200, 400).unsqueeze(1)).logits[:, -1]  # (200, V)
    top = logits.topk(3, dim=-1)
    probs = (top.values / 2.0).softmax(dim=-1)  # (200, 3)
    i = int((probs[:, 0] - 0.7).abs().argmin())  # a state left about 30% of the time
    state, ids, p = 200 + i, top.indices[i].tolist(), probs[i].double()
    assert ids[0] == state and 0.55 < p[0] < 0.85
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, speculative_config=NGRAM)
    outs = llm.generate([TokensPrompt(prompt_token_ids=[state] * 8)] * 200, SamplingParams(
        temperature=2.0, top_k=3, max_tokens=12, ignore_eos=True), use_tqdm=False)
    after = []
    for out in outs:
        seq = [state, *out.outputs[0].token_ids]
        after += [b for a, b in zip(seq, seq[1:]) if a == state]
    seen = torch.tensor([after.count(t) for t in ids], dtype=torch.float64)
    assert seen.sum() == len(after) > 400  # nothing outside the top 3
    chi2 = float(((seen - p * len(after)) ** 2 / (p * len(after))).sum())
    assert chi2 < 13.8, (seen, p * len(after))  # 2 degrees of freedom, p = 0.001
    drafts, drafted, kept = counts(llm)
    assert drafts > 0 and 0 < kept < drafted
