"""Drafts checked against logits (engine/draft_verifier.py): greedy rows keep the drafts the
argmax agrees with; sampled rows keep them by rejection sampling, whose tokens follow the
distribution of sampling one token at a time (checked against the exact probabilities)."""

import pytest
import torch
from structured_fixtures import toy_grammar

from pdserve.engine.draft_verifier import verify_drafts
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.step_records import ScheduledChunk
from pdserve.sampling_params import SamplingParams

VOCAB = 6


def chunk(drafts, **params):
    request = Request("r", [1, 2, 3], SamplingParams(**params))
    return ScheduledChunk(request, 2, 1 + len(drafts), [0], list(drafts))


def tokens(results):
    """(kept drafts, the token after them) of each chunk."""
    return [(kept, sample.token_id) for kept, sample in results]


def reference_probs(logits, temperature, top_k):
    """Softmax of logits / temperature over the top_k tokens of each row: (R, V)."""
    keep = logits >= logits.topk(top_k, dim=-1).values[:, -1:]
    return (logits / temperature).masked_fill(~keep, float("-inf")).softmax(dim=-1)


def test_greedy_rows_keep_the_drafts_the_argmax_agrees_with():
    logits = torch.full((6, VOCAB + 2), -1.0)  # the two padding columns are never chosen
    logits[:, VOCAB:] = 9.0
    for row, best in enumerate([3, 4, 0, 2, 5, 1]):
        logits[row, best] = 5.0
    chunks = [chunk([3, 1], temperature=0), chunk([2, 5], temperature=0)]
    # first chunk: draft 3 agrees with row 0, draft 1 not with row 1's 4, so 4 follows
    # second chunk (rows 3-5): both drafts agree, and row 5's argmax 1 follows them
    assert tokens(verify_drafts(chunks, logits, Sampler(VOCAB))) == [([3], 4), ([2, 5], 1)]


def test_sampled_rows_follow_one_token_at_a_time():
    """Chunks with two drafts each at temperature 0.8 and top_k 4: the first token drawn
    follows p0; given it is the first draft, the second follows p1; given both drafts, the
    third follows p2 (p0..p2 the rows' exact distributions). A greedy chunk in the same call
    keeps its argmax result."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(3, VOCAB, generator=gen) * 1.5  # (3, V): one chunk's three rows
    rows[0, 2] += 1.5  # the first draft (2) is likely but not certain
    rows[1, 4] += 1.0
    drafts, n = [2, 4], 24000
    probs = reference_probs(rows, 0.8, 4)  # (3, V)
    sampled = [chunk(drafts, temperature=0.8, top_k=4) for _ in range(n)]
    greedy = chunk([int(rows[0].argmax())], temperature=0)
    half = n // 2  # the greedy chunk between sampled ones: (3 half + 2 + 3 (n - half), V)
    logits = torch.cat([rows.repeat(half, 1), rows[:2], rows.repeat(n - half, 1)])
    results = tokens(verify_drafts(sampled[:half] + [greedy] + sampled[half:], logits,
                                   Sampler(VOCAB, seed=5)))
    assert results.pop(half) == ([int(rows[0].argmax())], int(rows[1].argmax()))
    emitted = [kept + [token] for kept, token in results]
    assert all(kept == drafts[:len(kept)] for kept, _ in results)
    for depth in range(3):  # the token at `depth`, among outputs that kept the drafts before
        picks = [e[depth] for e in emitted if e[:depth] == drafts[:depth]]
        counts = torch.bincount(torch.tensor(picks), minlength=VOCAB).double()
        expected = probs[depth].double() * len(picks)
        assert counts[expected == 0].sum() == 0  # nothing outside the top 4
        live = expected > 0
        chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
        assert len(picks) > 1000 and chi2 < 16.3, (depth, counts, expected)  # 3 dof, p=0.001


def test_a_draft_outside_top_k_is_always_refused_and_never_drawn():
    rows = torch.tensor([[4.0, 3.0, 2.0, -5.0, 1.0, 0.0]] * 2)
    results = tokens(verify_drafts([chunk([3], temperature=1.0, top_k=2) for _ in range(500)],
                                   rows.repeat(500, 1), Sampler(VOCAB)))
    assert {kept == [] for kept, _ in results} == {True}
    assert {token for _, token in results} == {0, 1}


def test_logprobs_come_from_the_rows_that_chose_each_token():
    """A greedy chunk asking for 2 logprobs keeps one draft of two: the draft's entry and the
    next token's are log-softmax of rows 0 and 1 (the refused draft's row 2 gives none); a
    chunk that did not ask gets none."""
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(dim=-1).tolist()
    wrong = (best[1] + 1) % VOCAB
    asked = chunk([best[0], wrong], temperature=0, logprobs=2)
    plain = chunk([best[3]], temperature=0)
    (kept, sample), (_, other) = verify_drafts([asked, plain], logits, Sampler(VOCAB))
    assert (kept, sample.token_id) == ([best[0]], best[1])
    reference = torch.log_softmax(logits, dim=-1)  # (5, V)
    entries = [*sample.draft_logprobs, sample.logprobs]
    assert len(entries) == 2
    for row, (token, entry) in enumerate(zip([best[0], best[1]], entries)):
        top = reference[row].topk(2).indices.tolist()
        assert set(entry) == {token, *top}
        for t, (logprob, rank) in entry.items():
            assert logprob == pytest.approx(reference[row, t].item(), abs=1e-6)
            assert rank == int((reference[row] >= reference[row, t]).sum())
    assert other.logprobs is None and other.draft_logprobs is None


def test_sampled_rows_are_checked_after_biases_and_penalties():
    """A logit bias of +100 on token 2 makes it certain: a sampled draft of 2 is always kept
    and 2 follows, a draft of 3 always refused. Token 2 leads the raw logits by 5, but a
    frequency penalty of 2 on an output holding it ten times puts it 15 behind: it is never
    drawn."""
    rows = torch.zeros(2, VOCAB)
    biased = [chunk([d], temperature=1.0, logit_bias={2: 100.0}) for d in (2, 3)] * 100
    results = tokens(verify_drafts(biased, rows.repeat(200, 1), Sampler(VOCAB)))
    assert results == [([2], 2), ([], 2)] * 100
    penalized = []
    for _ in range(200):
        c = chunk([4], temperature=1.0, frequency_penalty=2.0)
        c.request.output_token_ids.extend([2] * 10)
        penalized.append(c)
    rows[:, 2] = 5.0
    results = tokens(verify_drafts(penalized, rows.repeat(200, 1), Sampler(VOCAB)))
    assert {token for _, token in results} <= {0, 1, 3, 4, 5}


def test_constrained_rows_are_masked_as_their_grammar_stands_after_the_drafts_before_them():
    """Grammar "abc" (tokens 0, 1, 2, then the end, 5), drafts a, b. Each row's raw argmax is
    one the grammar forbids there (x, then a twice), so only the mask of each row's own place
    gives a, b, c: greedy keeps both drafts and takes c; sampled rows never leave the grammar.
    Verifying leaves the matcher where it was."""
    logits = torch.zeros(3, VOCAB)  # rows: before a, after a, after a b
    logits[0, 3], logits[1:, 0] = 9.0, 9.0
    logits[0, 0], logits[1, 1], logits[2, 2] = 5.0, 5.0, 5.0
    greedy = chunk([0, 1], temperature=0)
    greedy.request.grammar = toy_grammar("abc")
    assert tokens(verify_drafts([greedy], logits, Sampler(VOCAB))) == [([0, 1], 2)]
    sampled = []
    for drafts in ([0, 1], [0, 2]) * 50:  # the second draft c is refused: b is drawn
        sampled.append(chunk(drafts, temperature=1.0))
        sampled[-1].request.grammar = toy_grammar("abc")
    results = tokens(verify_drafts(sampled, logits.repeat(100, 1), Sampler(VOCAB)))
    assert results == [([0, 1], 2), ([0], 1)] * 50
    state = greedy.request.grammar
    assert state.accepted_prefix([0, 1, 2, 5]) == 4 and not state.is_terminated


def test_seeded_rows_keep_drafts_while_they_equal_one_at_a_times_draws():
    """Seeded chunks at temperature 1 with drafts 2, 4 after an output of two tokens: for each
    of 200 seeds, the kept drafts and the token after them are what sampling one token at a
    time with that seed draws (each output position from its own generator), up to the first
    draw that differs from a draft. Drafts are kept none, one and both times."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[0, 2] = logits[1, 4] = 2.0  # (3, V) likely enough to be kept, not always
    chunks = []
    for seed in range(200):
        chunks.append(chunk([2, 4], temperature=1.0, seed=seed))
        chunks[-1].request.output_token_ids.extend([1, 0])
    results = tokens(verify_drafts(chunks, logits.repeat(200, 1), Sampler(VOCAB)))
    for seed, result in enumerate(results):
        alone = Request("r", [1, 2, 3], SamplingParams(temperature=1.0, seed=seed))
        alone.output_token_ids.extend([1, 0])
        for row, draft in enumerate([2, 4, None]):
            token = Sampler(VOCAB)(logits[row:row + 1], [alone])[0].token_id
            if token != draft:
                break
            alone.output_token_ids.append(token)
        assert result == (alone.output_token_ids[2:], token), seed
    assert {len(kept) for kept, _ in results} == {0, 1, 2}


def test_rows_below_min_tokens_forbid_the_end_and_rows_past_it_allow_it():
    """min_tokens 3 after two output tokens, drafts 1, 2; the end token 5 leads every row.
    Row 0 (the third token) may not end, so draft 1 (next best) is kept; row 1 (the fourth)
    may, so the end follows instead of draft 2."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 5], logits[0, 1], logits[1, 2] = 9.0, 5.0, 5.0
    held = chunk([1, 2], temperature=0, min_tokens=3)
    held.request.eos_token_id = 5
    held.request.output_token_ids.extend([0, 0])
    assert tokens(verify_drafts([held], logits, Sampler(VOCAB))) == [([1], 5)]
