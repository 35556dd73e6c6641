from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, prompt_logprobs, sampling_probs
from pdserve.sampling_params import SamplingParams

V = 32


@dataclass
class Row:
    """The fields of a Request that the sampler reads."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    eos_token_id: int | None = None
    grammar: object = None  # structured outputs: tested in tests/engine/test_structured_outputs
    constant_logits_cache: dict = field(default_factory=dict)
    next_draw_generator = Request.next_draw_generator
    constant_logits = Request.constant_logits

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def make_logits(batch: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def test_all_greedy_fast_path_is_argmax_lowest_id_on_ties():
    logits = make_logits(4)
    logits[2, 5] = logits[2, 9] = 100.0
    results = Sampler(V)(logits, [Row(greedy()) for _ in range(4)])
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()
    assert results[2].token_id == 5
    assert all(r.logprobs is None for r in results)


def test_padded_vocab_columns_are_never_sampled():
    logits = make_logits(2, vocab=V + 8)
    logits[:, V:] = 1000.0
    rows = [Row(greedy()), Row(SamplingParams(seed=1))]
    assert all(r.token_id < V for r in Sampler(V)(logits, rows))


def test_logit_bias_forces_token_and_accepts_str_keys():
    logits = make_logits(2)
    rows = [Row(greedy(logit_bias={"7": 100.0})), Row(SamplingParams(logit_bias={11: 100.0}))]
    assert [r.token_id for r in Sampler(V)(logits, rows)] == [7, 11]
    processed = Sampler(V).process_logits(logits, [Row(greedy(logit_bias={3: -2.5}))] * 2)
    expected = logits.clone()
    expected[:, 3] -= 2.5
    torch.testing.assert_close(processed, expected)


def test_allowed_token_ids_restricts_greedy_and_random():
    allowed = [3, 17, 20]
    logits = make_logits(1)
    best = max(allowed, key=lambda t: logits[0, t].item())
    assert Sampler(V)(logits, [Row(greedy(allowed_token_ids=allowed))])[0].token_id == best
    batch = make_logits(400, seed=1)
    rows = [Row(SamplingParams(allowed_token_ids=allowed, temperature=2.0)) for _ in range(400)]
    tokens = {r.token_id for r in Sampler(V)(batch, rows)}
    assert tokens == set(allowed)


def test_bad_words_single_and_multi_token():
    logits = torch.zeros(1, V)
    logits[0, 4] = 10.0
    logits[0, 6] = 5.0
    sampler = Sampler(V)
    # One-token bad word: always banned.
    assert sampler(logits, [Row(greedy(), bad_words_token_ids=[[4]])])[0].token_id == 6

    def pick(**kwargs) -> int:
        row = Row(greedy(), bad_words_token_ids=[[1, 2, 4]], **kwargs)
        return sampler(logits, [row])[0].token_id

    # Multi-token [1, 2, 4]: 4 is banned only right after 1, 2.
    assert pick(output_token_ids=[9, 1, 2]) == 6
    assert pick(output_token_ids=[1, 2, 9]) == 4
    assert pick(output_token_ids=[2]) == 4
    assert pick(prompt_token_ids=[1, 2]) == 4  # the prompt is not part of the match


def test_min_tokens_blocks_eos_and_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, 2] = 10.0  # eos
    logits[0, 9] = 9.0  # stop token
    logits[0, 5] = 1.0
    sampler = Sampler(V)
    p = greedy(min_tokens=3, stop_token_ids=[9])
    assert sampler(logits, [Row(p, output_token_ids=[1, 1], eos_token_id=2)])[0].token_id == 5
    assert sampler(logits, [Row(p, output_token_ids=[1, 1, 1], eos_token_id=2)])[0].token_id == 2
    ignore = greedy(min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    assert sampler(logits, [Row(ignore, output_token_ids=[], eos_token_id=2)])[0].token_id == 2
    logits[0, 2] = 0.0
    assert sampler(logits, [Row(ignore, output_token_ids=[], eos_token_id=2)])[0].token_id == 5


def test_repetition_penalty_matches_reference():
    logits = make_logits(1)
    row = Row(greedy(repetition_penalty=1.7), prompt_token_ids=[1, 2, 3], output_token_ids=[3, 8])
    processed = Sampler(V).process_logits(logits, [row])
    expected = logits.clone()
    for t in {1, 2, 3, 8}:
        x = expected[0, t]
        expected[0, t] = x / 1.7 if x > 0 else x * 1.7
    torch.testing.assert_close(processed, expected)


def test_frequency_and_presence_penalties_match_reference():
    logits = make_logits(2)
    rows = [
        Row(greedy(frequency_penalty=0.5, presence_penalty=1.0), prompt_token_ids=[4, 4],
            output_token_ids=[1, 1, 1, 7]),
        Row(greedy(presence_penalty=-0.5), output_token_ids=[7, 7]),
    ]
    processed = Sampler(V).process_logits(logits, rows)
    expected = logits.clone()
    expected[0, 1] -= 0.5 * 3 + 1.0
    expected[0, 7] -= 0.5 * 1 + 1.0
    expected[1, 7] += 0.5
    torch.testing.assert_close(processed, expected)


def test_sampling_probs_filters_match_reference():
    logits = make_logits(1, seed=3)
    p = SamplingParams(temperature=0.7, top_k=10, top_p=0.6, min_p=0.05)
    probs = sampling_probs(logits, [p])[0]
    # Reference: temperature, min_p, top_k, top_p (renormalised at each step), as vLLM.
    ref = logits[0] / 0.7
    base = ref.softmax(-1)
    ref = ref.masked_fill(base < base.max() * 0.05, float("-inf"))
    kth = ref.sort(descending=True).values[9]
    ref = ref.masked_fill(ref < kth, float("-inf"))
    order = ref.argsort(descending=True)
    keep, mass = [], 0.0
    soft = ref.softmax(-1)
    for t in order.tolist():
        if mass >= 0.6:
            break
        keep.append(t)
        mass += soft[t].item()
    expected = torch.full_like(ref, float("-inf"))
    expected[keep] = ref[keep]
    torch.testing.assert_close(probs, expected.softmax(-1))
    assert 1 <= len(keep) < 10


@pytest.mark.parametrize("top_p, kept", [(0.4, 1), (0.7, 2), (0.8, 3), (0.95, 4), (1.0, 4)])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    base = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = base.log().unsqueeze(0)  # (1, 4)
    probs = sampling_probs(logits, [SamplingParams(top_p=top_p)])[0]
    expected = torch.zeros(4)
    expected[:kept] = base[:kept] / base[:kept].sum()
    torch.testing.assert_close(probs, expected)


def test_top_p_below_float32s_smallest_keeps_the_likeliest_token():
    logits = make_logits(1, seed=3)
    probs = sampling_probs(logits, [SamplingParams(top_p=1e-300)])[0]  # 0 in float32
    expected = torch.zeros(V)
    expected[logits[0].argmax()] = 1.0
    torch.testing.assert_close(probs, expected)


def test_repetition_penalty_past_float32_gives_the_seen_tokens_not_nan():
    """A penalty so small that the seen tokens' positive logits overflow float32: they become
    the largest float (equal), so greedy takes the first of them and draws pick among them."""
    logits = make_logits(1, seed=4)
    seen = [t for t in range(V) if logits[0, t] > 0][:3]
    rows = [Row(SamplingParams(temperature=t, seed=s, repetition_penalty=1e-40),
                prompt_token_ids=seen)
            for t, s in [(0, None)] + [(t, s) for t in (1.0, 0.5) for s in range(20)]]
    tokens = [r.token_id for r in Sampler(V)(logits.expand(len(rows), V).contiguous(), rows)]
    assert tokens[0] == min(seen)
    for drawn in (tokens[1:21], tokens[21:]):  # temperature 1, then 0.5 (max / 0.5 is inf)
        assert set(drawn) <= set(seen) and len(set(drawn)) > 1


def test_a_huge_penalty_on_every_allowed_token_still_draws_one_of_them():
    """3e38 times a negative logit is -inf in float32; the allowed tokens, all seen, would
    all be -inf beside the masked rest."""
    logits = -make_logits(1, seed=6).abs() - 1  # every logit negative
    allowed = [2, 9, 17]
    rows = [Row(SamplingParams(temperature=t, seed=s, repetition_penalty=3e38,
                               allowed_token_ids=allowed), prompt_token_ids=allowed)
            for t, s in [(0, None), (1.0, 1), (0.5, 2), (2.0, 3)]]
    tokens = [r.token_id for r in Sampler(V)(logits.expand(len(rows), V).contiguous(), rows)]
    assert set(tokens) <= set(allowed)


@pytest.mark.parametrize("kwargs", [{"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.1}])
def test_sampled_tokens_stay_in_filtered_set(kwargs):
    logits = make_logits(1, seed=5).expand(300, V).contiguous()
    p = SamplingParams(temperature=1.5, **kwargs)
    support = set(torch.nonzero(sampling_probs(logits[:1], [p])[0]).flatten().tolist())
    assert 1 < len(support) < 8
    if "top_k" in kwargs:
        assert support == set(logits[0].topk(3).indices.tolist())
    rows = [Row(SamplingParams(temperature=1.5, seed=s, **kwargs)) for s in range(150)]
    rows += [Row(SamplingParams(temperature=1.5, **kwargs)) for _ in range(150)]
    tokens = [r.token_id for r in Sampler(V)(logits, rows)]
    assert set(tokens) <= support
    assert len(set(tokens)) > 1


def test_random_sampling_follows_distribution():
    torch.manual_seed(0)
    row_logits = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4))
    n = 4000
    results = Sampler(V)(row_logits.expand(n, V).contiguous(), [Row(SamplingParams())] * n)
    counts = torch.bincount(torch.tensor([r.token_id for r in results]), minlength=V).float() / n
    torch.testing.assert_close(counts[:4], row_logits.softmax(-1)[:4], atol=0.03, rtol=0)


def test_draws_across_blocks_follow_the_distribution_and_skip_zero_mass():
    """draw_tokens over 700 tokens (blocks of 256 and a padded last one): the counts of a
    mass spread over three blocks follow it (chi-square against the exact probabilities),
    and no token of zero mass is ever drawn, at block edges included."""
    from pdserve.engine.sampler import draw_tokens

    vocab, n = 700, 30000
    probs = torch.zeros(vocab)
    mass = {0: 0.05, 255: 0.2, 256: 0.1, 300: 0.25, 511: 0.15, 512: 0.05, 699: 0.2}
    for t, m in mass.items():
        probs[t] = m * 3.0  # unnormalized rows are fine
    gen = torch.Generator().manual_seed(7)
    tokens = draw_tokens(probs.expand(n, vocab).contiguous(), [Row(SamplingParams())] * n, gen)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    want = torch.tensor([mass[t] for t in mass], dtype=torch.float64) * n
    chi2 = float(((counts[list(mass)] - want) ** 2 / want).sum())
    assert chi2 < 22.5, (counts[list(mass)], want)  # 6 degrees of freedom, p = 0.001


def test_seeded_rows_ignore_batch_composition_and_order():
    logits = make_logits(6, seed=7)
    params = [SamplingParams(seed=11), SamplingParams(seed=22, top_p=0.9), SamplingParams(top_k=5),
              greedy(), SamplingParams(seed=33, temperature=0.5, min_p=0.1),
              SamplingParams(repetition_penalty=1.2)]
    full = [r.token_id for r in Sampler(V)(logits, [Row(p) for p in params])]
    seeded = [0, 1, 4]
    for i in seeded:
        alone = Sampler(V)(logits[i:i + 1], [Row(params[i])])[0].token_id
        assert alone == full[i]
    order = [4, 5, 2, 1, 3, 0]
    shuffled = Sampler(V)(logits[order], [Row(params[i]) for i in order])
    for pos, i in enumerate(order):
        if i in seeded:
            assert shuffled[pos].token_id == full[i]


def test_seeded_sequence_is_reproducible_and_seed_dependent():
    logits = make_logits(1, seed=9)
    flat = logits.expand(1, V) * 0.1  # near-uniform so seeds diverge

    def run(seed: int, given: list[int] = (), steps: int = 20) -> list[int]:
        row = Row(SamplingParams(seed=seed), output_token_ids=list(given))
        for _ in range(steps):  # the engine appends each sampled token
            row.output_token_ids.append(Sampler(V)(flat, [row])[0].token_id)
        return row.output_token_ids

    assert run(1) == run(1) and len(set(run(1))) > 1
    assert run(1) != run(2)
    # Continued elsewhere with the tokens so far (a migration, a prefill's first token), a
    # sequence draws what it would have drawn, with nothing replayed.
    assert run(1, given=run(1)[:12], steps=8) == run(1)


def test_logprobs_are_raw_with_correct_ranks():
    logits = make_logits(3, seed=4)
    logits[1, 6] = logits[1, 8] = 50.0  # tie at the top
    rows = [Row(SamplingParams(logprobs=3, temperature=0.3, repetition_penalty=2.0,
                               logit_bias={0: 50.0}, seed=1), prompt_token_ids=[1, 2]),
            Row(greedy(logprobs=0, logit_bias={6: -100.0})),
            Row(greedy(logprobs=-1))]
    results = Sampler(V)(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert results[0].token_id == 0  # bias applied to sampling...
    for i, (res, k) in enumerate(zip(results, [3, 0, V])):
        lp = res.logprobs
        token_lp, token_rank = lp[res.token_id]
        # ...but logprobs come from the raw logits.
        assert token_lp == pytest.approx(raw[i, res.token_id].item(), abs=1e-5)
        top = raw[i].topk(k).indices.tolist() if k else []
        assert set(lp) == set(top) | {res.token_id}
        for t in top:
            assert lp[t][0] == pytest.approx(raw[i, t].item(), abs=1e-5)
        if res.token_id not in top:
            assert token_rank == int((raw[i] >= raw[i, res.token_id]).sum())
    assert results[1].token_id == 8
    assert results[1].logprobs == {8: pytest.approx((raw[1, 8].item(), 2))}
    assert sorted(r for _, r in results[2].logprobs.values()) == list(range(1, V + 1))
    assert list(results[0].logprobs)[0] == 0  # the sampled token comes first


def test_prompt_logprobs():
    logits = make_logits(5, seed=2)
    targets = [3, 1, 4, 1, 5]
    raw = torch.log_softmax(logits, -1)
    out = prompt_logprobs(logits, targets, 2)
    assert len(out) == 5
    for t, d in enumerate(out):
        lp, rank = d[targets[t]]
        assert lp == pytest.approx(raw[t, targets[t]].item(), abs=1e-5)
        top2 = raw[t].topk(2).indices.tolist()
        expected_rank = top2.index(targets[t]) + 1 if targets[t] in top2 else int(
            (raw[t] > raw[t, targets[t]]).sum()) + 1
        assert rank == expected_rank
        assert set(d) == set(top2) | {targets[t]}
    only = prompt_logprobs(logits, targets, 0)
    assert all(list(d) == [targets[t]] for t, d in enumerate(only))


def test_sampler_does_not_mutate_rows_or_logits():
    logits = make_logits(3)
    before = logits.clone()
    rows = [Row(SamplingParams(logit_bias={1: 5.0}, repetition_penalty=1.5, presence_penalty=0.5,
                               allowed_token_ids=[1, 2, 3], logprobs=2, min_tokens=4, seed=1),
                prompt_token_ids=[1, 2], output_token_ids=[3], bad_words_token_ids=[[3, 2]],
                eos_token_id=2),
            Row(greedy(), output_token_ids=[5]), Row(SamplingParams(top_k=2))]
    snapshot = [(copy.deepcopy(r.sampling_params), list(r.prompt_token_ids),
                 list(r.output_token_ids), copy.deepcopy(r.bad_words_token_ids)) for r in rows]
    Sampler(V)(logits, rows)
    torch.testing.assert_close(logits, before, rtol=0, atol=0)
    after = [(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.bad_words_token_ids)
             for r in rows]
    assert after == [tuple(s) for s in snapshot]


def test_whole_vocabulary_bias_and_allowed_ids_are_built_once_per_request():
    """A request allowing and biasing every token (and ids past the vocabulary, which are
    dropped): its processed logits are the raw ones plus its biases, and later steps reuse
    the tensors its first step built."""
    bias = {t: (t % 7) / 4 - 0.5 for t in range(V + 3)}
    row = Row(greedy(allowed_token_ids=list(range(V + 3)), logit_bias=bias))
    expected = make_logits(1)
    expected[0] += torch.tensor([bias[t] for t in range(V)])
    for step in range(2):
        torch.testing.assert_close(Sampler(V).process_logits(make_logits(1), [row]), expected,
                                   rtol=0, atol=0)
        if step == 0:
            built = dict(row.constant_logits_cache)
    assert len(built) == 1 and row.constant_logits_cache == built  # the same tensors
