"""Checking a step's drafts (ngram_drafts.py) against the model's logits.

A greedy sequence keeps its drafts up to the first that is not the argmax before it, and takes
the argmax after the last kept one: the tokens of decoding one token at a time.

A sampled sequence with a seed draws each row's token as one token at a time draws it there
(the generator of its seed and that output position, request.py) and keeps its drafts up to
the first that differs from the draw: its tokens are those of decoding one at a time with that
seed, however many drafts each step had room for. A draft d is then kept with probability
p(d), as rejection sampling keeps it.

A sampled sequence without a seed keeps them by rejection sampling, so its tokens follow the
distribution of sampling one token at a time. A prompt-lookup draft proposes one token with
certainty, so a draft d at a position whose sampling distribution is p is kept with
probability p(d); the first refused draft is replaced by a draw from p without d
(renormalized), and when every draft is kept the token after them is drawn from the
distribution there. p is what the sampler draws from: temperature, then min_p, top_k and
top_p (sampler.py).

Logits are checked after the request's logit_bias, allowed_token_ids, bad words, min_tokens,
penalties and grammar, each row's as one token at a time would have them: its output followed
by the drafts before the row. A request that asks for logprobs gets them for each kept draft
and for the token after, from the raw logits of the row that chose it, as vLLM returns them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import (SampleResult, Sampler, changes_logits, draw_tokens,
                                    sampling_probs, token_logprobs)
from pdserve.engine.step_records import ScheduledChunk
from pdserve.kernels.cpu_argmax import argmax_rows

_SAMPLING_EPS = 1e-5


def verify_drafts(chunks: Sequence[ScheduledChunk], logits: torch.Tensor,
                  sampler: Sampler) -> list[tuple[list[int], SampleResult]]:
    """logits: (sum of 1 + drafts, V'), each chunk's rows in order: its last known token's row,
    then one row per draft. Returns, per chunk, the drafts kept and the token that follows
    them (with the logprobs of both, where asked). Unseeded sampled rows draw from the
    sampler's engine generator, seeded ones from their own."""
    logits = logits[:, :sampler.vocab_size]  # (R, V) raw
    checked = _processed(chunks, logits, sampler)  # (R, V) what each row's token comes from
    firsts, greedy_rows, seeded_rows, sampled_rows = [], [], [], []
    seeded_views: list[_DraftRow] = []  # one per seeded row: its place in the output
    row = 0
    for chunk in chunks:
        firsts.append(row)
        n = len(chunk.draft_token_ids) + 1
        p = chunk.request.sampling_params
        if p.temperature < _SAMPLING_EPS:
            greedy_rows.extend(range(row, row + n))
        elif p.seed is None:
            sampled_rows.extend(range(row, row + n))
        else:
            seeded_rows.extend(range(row, row + n))
            seeded_views.extend(_DraftRow(chunk.request, chunk.draft_token_ids[:j])
                                for j in range(n))
        row += n
    choices = {}  # row -> the token one at a time takes there
    if greedy_rows:
        choices.update(zip(greedy_rows, argmax_rows(_rows(checked, greedy_rows)).tolist()))
    if seeded_rows:
        probs = sampling_probs(_rows(checked, seeded_rows).to(torch.float32),
                               [v.sampling_params for v in seeded_views])  # (S, V)
        drawn = draw_tokens(probs, seeded_views, sampler.generator(logits.device))  # (S,)
        choices.update(zip(seeded_rows, drawn.tolist()))
    results: list[tuple[list[int], int] | None] = [None] * len(chunks)
    for i, chunk in enumerate(chunks):
        if firsts[i] in choices:
            at = [choices[firsts[i] + j] for j in range(len(chunk.draft_token_ids) + 1)]
            results[i] = _keep_equal(chunk.draft_token_ids, at)
    if sampled_rows:
        picked = [(i, c) for i, c in enumerate(chunks) if results[i] is None]
        tokens = _rejection_sample([c for _, c in picked], _rows(checked, sampled_rows),
                                   sampler.generator(logits.device))
        for (i, _), result in zip(picked, tokens):
            results[i] = result
    return _with_logprobs(chunks, firsts, logits, results)  # type: ignore[arg-type]


def _with_logprobs(chunks: Sequence[ScheduledChunk], firsts: list[int], logits: torch.Tensor,
                   results: list[tuple[list[int], int]]) -> list[tuple[list[int], SampleResult]]:
    """logits: (R, V) raw. Each chunk's result, with the logprobs of its kept drafts and of
    the token after them from the rows that chose them, where its request asked."""
    rows, tokens, params = [], [], []
    for chunk, first, (kept, token) in zip(chunks, firsts, results):
        p = chunk.request.sampling_params
        if p.logprobs is not None:
            rows.extend(range(first, first + len(kept) + 1))
            tokens.extend((*kept, token))
            params.extend([p] * (len(kept) + 1))
    dicts = iter(token_logprobs(_rows(logits, rows), torch.tensor(tokens, device=logits.device),
                                params) if rows else [])
    out = []
    for chunk, (kept, token) in zip(chunks, results):
        if chunk.request.sampling_params.logprobs is None:
            out.append((kept, SampleResult(token, None)))
        else:
            drafts = [next(dicts) for _ in kept]
            out.append((kept, SampleResult(token, next(dicts), drafts)))
    return out


class _DraftRow:
    """A drafted chunk's request as one of its rows sees it: the request's output followed by
    the drafts before the row (what penalties, bad words and min_tokens read), its grammar
    after those drafts, and the seeded generator of the row's output position."""

    __slots__ = ("request", "output_token_ids", "grammar")

    def __init__(self, request: Request, drafts_before: list[int]):
        self.request = request
        self.output_token_ids = [*request.output_token_ids, *drafts_before]
        grammar = request.grammar
        self.grammar = grammar.after(drafts_before) if grammar is not None else None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    next_draw_generator = Request.next_draw_generator  # at num_output_tokens: the row's place

    def __getattr__(self, name: str):
        return getattr(self.request, name)


def _processed(chunks: Sequence[ScheduledChunk], logits: torch.Tensor,
               sampler: Sampler) -> torch.Tensor:
    """logits: (R, V) raw. The same rows after each request's masks, biases and penalties,
    or `logits` itself when no request has any."""
    rows: list[int] = []
    views: list[_DraftRow] = []
    first = 0
    for c in chunks:
        n = len(c.draft_token_ids) + 1
        if changes_logits(c.request):
            rows.extend(range(first, first + n))
            views.extend(_DraftRow(c.request, c.draft_token_ids[:j]) for j in range(n))
        first += n
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)  # (R, V)
    at = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out[at] = sampler.process_logits(logits[at], views)
    return out


def _keep_equal(drafts: list[int], choices: list[int]) -> tuple[list[int], int]:
    """Drafts up to the first that differs from the choice at its place, and the choice after."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == choices[kept]:
        kept += 1
    return drafts[:kept], choices[kept]


def _rejection_sample(chunks: list[ScheduledChunk], logits: torch.Tensor,
                      generator: torch.Generator) -> list[tuple[list[int], int]]:
    """Sampled chunks, logits (R, V): their rows in order, as verify_drafts'."""
    params = [c.request.sampling_params for c in chunks for _ in range(len(c.draft_token_ids) + 1)]
    probs = sampling_probs(logits.to(torch.float32), params)  # (R, V)
    draft_rows, draft_ids, firsts = [], [], []
    row = 0
    for chunk in chunks:
        firsts.append(row)
        draft_rows.extend(range(row, row + len(chunk.draft_token_ids)))
        draft_ids.extend(chunk.draft_token_ids)
        row += len(chunk.draft_token_ids) + 1
    device = probs.device
    rows_t = torch.tensor(draft_rows, dtype=torch.long, device=device)
    ids_t = torch.tensor(draft_ids, dtype=torch.long, device=device)
    chance = probs[rows_t, ids_t]  # (D,) each draft's probability where it stands
    uniform = torch.rand(len(draft_rows), dtype=probs.dtype, device=device, generator=generator)
    keeps = (uniform < chance).tolist()  # (D,)
    kept_counts, final_rows, removed = [], [], []
    d = 0
    for chunk, first in zip(chunks, firsts):
        k = len(chunk.draft_token_ids)
        kept = 0
        while kept < k and keeps[d + kept]:
            kept += 1
        d += k
        kept_counts.append(kept)
        final_rows.append(first + kept)
        removed.append(chunk.draft_token_ids[kept] if kept < k else -1)
    final = probs[torch.tensor(final_rows, dtype=torch.long, device=device)]  # (C, V)
    refused = [j for j, t in enumerate(removed) if t >= 0]
    if refused:
        at = torch.tensor(refused, dtype=torch.long, device=device)
        residual = final[at].index_put_(
            (torch.arange(len(refused), device=device),
             torch.tensor([removed[j] for j in refused], dtype=torch.long, device=device)),
            torch.zeros((), dtype=final.dtype, device=device))  # (r, V) p without the draft
        # a refusal of a draft holding all the mass leaves nothing: keep p as it was
        empty = residual.sum(dim=-1, keepdim=True) <= 0  # (r, 1)
        final[at] = torch.where(empty, final[at], residual)
    drawn = draw_tokens(final, [c.request for c in chunks], generator).tolist()  # (C,)
    return [(chunk.draft_token_ids[:kept], token)
            for chunk, kept, token in zip(chunks, kept_counts, drawn)]


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == logits.shape[0]:
        return logits
    return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
