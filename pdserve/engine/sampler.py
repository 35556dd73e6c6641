"""Batched token sampling from logits, with vLLM's logits processing and logprobs semantics.

Order of processing (as in vLLM v1): allowed_token_ids mask, bad words, min_tokens, logit_bias,
repetition / frequency / presence penalties, the structured-output grammar's mask; then greedy
rows take the argmax, random rows go through temperature, min_p, top_k, top_p and one uniform
draw each through the cumulative probabilities (per-row generator if seeded).
Logprobs are always those of the raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.structured_output import apply_grammar_masks
from pdserve.kernels.cpu_argmax import argmax_rows

if TYPE_CHECKING:
    from pdserve.engine.request import Request
    from pdserve.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5
_NEG_INF = float("-inf")
_FLOAT32_MAX = torch.finfo(torch.float32).max
_PROMPT_CHUNK = 1024
_DRAW_BLOCK = 256  # tokens a block of the cumulative sums in draw_tokens
# A step's prompt logprobs of one request: (its chunk's first position, {token: (logprob,
# rank)} for each prompt token after it). A chunk computed again repeats earlier positions.
PromptLogprobChunk = tuple[int, list[dict[int, tuple[float, int]]]]


@dataclass
class SampleResult:
    token_id: int
    # token id -> (logprob, 1-based rank) under the raw logits; None unless logprobs requested.
    logprobs: dict[int, tuple[float, int]] | None
    # with drafts (draft_verifier.py): the same for each kept draft, in order, before token_id
    draft_logprobs: list[dict[int, tuple[float, int]]] | None = None


class Sampler:
    """Samples one token per row. Reads rows, never writes them. A row with a seed draws from
    its own generator; the others share the engine's, seeded with the engine's `seed` (as
    vLLM seeds its workers), so a run of unseeded requests repeats run to run."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The engine's generator for unseeded rows on `device`."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return gen

    def __call__(self, logits: torch.Tensor, rows: Sequence[Request]) -> list[SampleResult]:
        """logits: (B, V') with V' >= vocab_size; row i of logits belongs to rows[i]."""
        logits = logits[:, : self.vocab_size]  # (B, V)
        params = [row.sampling_params for row in rows]
        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        want_logprobs = [p.logprobs is not None for p in params]
        needs_processing = any(map(changes_logits, rows))

        if all(greedy) and not needs_processing and not any(want_logprobs):
            return [SampleResult(t, None) for t in argmax_rows(logits).tolist()]

        raw = logits
        if needs_processing:
            processed = self.process_logits(logits, rows)
        else:
            processed = logits.to(torch.float32)  # (B, V)
        tokens = _sample(processed, rows, greedy, self.generator(processed.device))  # (B,)

        results = [SampleResult(t, None) for t in tokens.tolist()]
        idx = [i for i, want in enumerate(want_logprobs) if want]
        if idx:
            dicts = token_logprobs(raw[idx], tokens[idx], [params[i] for i in idx])
            for i, d in zip(idx, dicts):
                results[i].logprobs = d
        return results

    def process_logits(self, logits: torch.Tensor, rows: Sequence[Request]) -> torch.Tensor:
        """A float32 copy (B, V) of logits with allowed_token_ids, bad words, min_tokens,
        logit_bias, the penalties and the structured-output grammars applied: what greedy rows
        take the argmax of."""
        out = logits[:, : self.vocab_size].to(torch.float32, copy=True)  # (B, V)
        _apply_masks_and_bias(out, rows)
        _apply_penalties(out, rows)
        apply_grammar_masks(out, rows)
        return out


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], k: int
) -> list[dict[int, tuple[float, int]]]:
    """logits: (T, V) at prompt positions; entry t gives next_token_ids[t] and the top-k
    (k = -1: whole vocab) as token id -> (logprob, rank)."""
    out: list[dict[int, tuple[float, int]]] = []
    targets = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device)  # (T,)
    for start in range(0, logits.shape[0], _PROMPT_CHUNK):
        stop = start + _PROMPT_CHUNK
        chunk = logits[start:stop]
        out.extend(_logprob_dicts(chunk, targets[start:stop], [k] * chunk.shape[0]))
    return out


def changes_logits(row: Request) -> bool:
    """Whether `process_logits` changes the row's logits (masks, biases, penalties, grammar)."""
    p = row.sampling_params
    return bool(
        row.grammar is not None
        or p.logit_bias
        or p.allowed_token_ids is not None
        or row.bad_words_token_ids
        or (p.min_tokens and len(row.output_token_ids) < p.min_tokens)
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


def _index(rows: list[int], cols: list[int],
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(cols, dtype=torch.long, device=device))


def _banned_tokens(row: Request) -> list[int]:
    """Bad-word completions and, below min_tokens, the stop tokens (EOS unless ignore_eos)."""
    p = row.sampling_params
    out = row.output_token_ids
    banned: list[int] = []
    for word in row.bad_words_token_ids:
        if not word:
            continue
        prefix_len = len(word) - 1
        if prefix_len == 0 or (prefix_len <= len(out) and out[len(out) - prefix_len:] == word[:-1]):
            banned.append(word[-1])
    if p.min_tokens and len(out) < p.min_tokens:
        banned.extend(p.stop_token_ids or ())
        if row.eos_token_id is not None and not p.ignore_eos:
            banned.append(row.eos_token_id)
    return banned


def _apply_masks_and_bias(logits: torch.Tensor, rows: Sequence[Request]) -> None:
    """In place on logits (B, V): allowed_token_ids, bad words, min_tokens, logit_bias."""
    vocab = logits.shape[1]
    device = logits.device

    allowed = [i for i, row in enumerate(rows) if row.sampling_params.allowed_token_ids is not None]
    if allowed:
        mask = torch.stack([rows[i].constant_logits(vocab, device).forbidden
                            for i in allowed])  # (n, V)
        idx = torch.tensor(allowed, dtype=torch.long, device=device)
        logits[idx] = logits[idx].masked_fill(mask, _NEG_INF)

    r, c = [], []
    for i, row in enumerate(rows):
        ids = [t for t in _banned_tokens(row) if 0 <= t < vocab]
        r.extend([i] * len(ids))
        c.extend(ids)
    if r:
        logits[_index(r, c, device)] = _NEG_INF

    biased = [i for i, row in enumerate(rows) if row.sampling_params.logit_bias]
    if biased:  # + 0 leaves the other tokens as they are
        bias = torch.stack([rows[i].constant_logits(vocab, device).bias
                            for i in biased])  # (n, V)
        logits.index_add_(0, torch.tensor(biased, dtype=torch.long, device=device), bias)


def _within_float32(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """`after`, computed from `before` by a factor, with what overflowed float32 set to the
    largest float of its sign: a penalty or a bias near float32's limits, divided by a
    temperature below 1, must not make infs (several of them make the softmax NaN). What was
    -inf before (a masked token) stays -inf."""
    return torch.where(before.isneginf(), before,
                       after.clamp(min=-_FLOAT32_MAX, max=_FLOAT32_MAX))


def _apply_penalties(logits: torch.Tensor, rows: Sequence[Request]) -> None:
    """In place on logits (B, V). Repetition penalty over prompt + output tokens (divide positive
    logits, multiply negative ones); frequency and presence penalties over output tokens."""
    vocab = logits.shape[1]
    device = logits.device

    rep = [i for i, row in enumerate(rows) if row.sampling_params.repetition_penalty != 1.0]
    if rep:
        r, c = [], []
        for j, i in enumerate(rep):
            ids = [t for t in rows[i].prompt_token_ids + rows[i].output_token_ids if 0 <= t < vocab]
            r.extend([j] * len(ids))
            c.extend(ids)
        seen = torch.zeros(len(rep), vocab, dtype=torch.bool, device=device)  # (n, V)
        seen[_index(r, c, device)] = True
        penalty = torch.tensor([rows[i].sampling_params.repetition_penalty for i in rep],
                               dtype=logits.dtype, device=device).unsqueeze(1)  # (n, 1)
        idx = torch.tensor(rep, dtype=torch.long, device=device)
        sub = logits[idx]  # (n, V)
        penalized = _within_float32(sub, torch.where(sub > 0, sub / penalty, sub * penalty))
        logits[idx] = torch.where(seen, penalized, sub)

    freq = [i for i, row in enumerate(rows)
            if row.sampling_params.frequency_penalty or row.sampling_params.presence_penalty]
    if freq:
        r, c = [], []
        for j, i in enumerate(freq):
            ids = [t for t in rows[i].output_token_ids if 0 <= t < vocab]
            r.extend([j] * len(ids))
            c.extend(ids)
        counts = torch.zeros(len(freq), vocab, dtype=logits.dtype, device=device)  # (n, V)
        ones = torch.ones(len(r), dtype=logits.dtype, device=device)
        counts.index_put_(_index(r, c, device), ones, accumulate=True)
        fp = torch.tensor([[rows[i].sampling_params.frequency_penalty] for i in freq],
                          dtype=logits.dtype, device=device)  # (n, 1)
        pp = torch.tensor([[rows[i].sampling_params.presence_penalty] for i in freq],
                          dtype=logits.dtype, device=device)  # (n, 1)
        idx = torch.tensor(freq, dtype=torch.long, device=device)
        logits[idx] = logits[idx] - fp * counts - pp * (counts > 0).to(logits.dtype)


def _sample(logits: torch.Tensor, rows: Sequence[Request], greedy: list[bool],
            generator: torch.Generator) -> torch.Tensor:
    """logits: (B, V) processed; `generator` draws for unseeded rows. Returns token ids (B,)
    long."""
    device = logits.device
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=device)  # (B,)
    greedy_idx = [i for i, g in enumerate(greedy) if g]
    random_idx = [i for i, g in enumerate(greedy) if not g]
    if greedy_idx:
        idx = torch.tensor(greedy_idx, dtype=torch.long, device=device)
        tokens[idx] = argmax_rows(logits[idx]).to(device)
    if random_idx:
        idx = torch.tensor(random_idx, dtype=torch.long, device=device)
        sub_rows = [rows[i] for i in random_idx]
        probs = sampling_probs(logits[idx], [r.sampling_params for r in sub_rows])  # (n, V)
        tokens[idx] = draw_tokens(probs, sub_rows, generator)
    return tokens


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution random rows draw from: logits (n, V) (already processed) divided by
    temperature, then min_p, top_k and top_p filters (in that order, as vLLM). Returns (n, V)."""
    device = logits.device
    vocab = logits.shape[1]
    temps = torch.tensor([[p.temperature] for p in params], dtype=logits.dtype, device=device)
    if any(p.logit_bias or p.repetition_penalty != 1.0 for p in params):
        logits = _within_float32(logits, logits / temps)  # biases or penalties near its limits
    else:
        logits = logits / temps

    def column(values: list[float], rows: list[int]) -> torch.Tensor:  # (m, 1)
        return torch.tensor([[values[j]] for j in rows], dtype=logits.dtype, device=device)

    min_p = [p.min_p for p in params]
    rows = [j for j, m in enumerate(min_p) if m > 0.0]
    if rows:
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        sub = logits[idx]  # (m, V)
        probs = sub.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * column(min_p, rows)  # (m, 1)
        logits[idx] = sub.masked_fill(probs < threshold, _NEG_INF)

    top_k = [p.top_k for p in params]
    rows = [j for j, k in enumerate(top_k) if 0 < k < vocab]
    if rows:
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        sub = logits[idx]  # (m, V)
        k = torch.tensor([[top_k[j] - 1] for j in rows], dtype=torch.long, device=device)
        kth = sub.topk(max(top_k[j] for j in rows), dim=-1).values.gather(1, k)  # (m, 1)
        logits[idx] = sub.masked_fill(sub < kth, _NEG_INF)

    top_p = [p.top_p for p in params]
    rows = [j for j, p in enumerate(top_p) if p < 1.0]
    if rows:
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        sub = logits[idx]  # (m, V)
        sorted_logits, order = sub.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        better_mass = torch.zeros_like(sorted_probs)  # mass of the tokens ranked above
        better_mass[:, 1:] = sorted_probs.cumsum(dim=-1)[:, :-1]
        drop_sorted = better_mass >= column(top_p, rows)
        drop_sorted[:, 0] = False  # the likeliest token stays, however small top_p is in float32
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits[idx] = sub.masked_fill(drop, _NEG_INF)

    return logits.softmax(dim=-1)


def draw_tokens(probs: torch.Tensor, rows: Sequence[Request],
                generator: torch.Generator) -> torch.Tensor:
    """probs: (n, V), each row non-negative with positive mass. Draws token t of row j with
    probability probs[j, t] / sum(probs[j]) by one uniform draw per row, through the row's
    cumulative sums: first over blocks of _DRAW_BLOCK tokens, then within the block it lands
    in (in float64). A seeded row draws from its own generator only, so its token ignores the
    rest of the batch; other rows share `generator`. Returns (n,) long."""
    n, vocab = probs.shape
    u = torch.empty(n, 1, dtype=torch.float64, device=probs.device)  # (n, 1) in [0, 1)
    unseeded = [j for j, row in enumerate(rows) if row.sampling_params.seed is None]
    if unseeded:
        idx = torch.tensor(unseeded, dtype=torch.long, device=probs.device)
        u[idx] = torch.rand(len(unseeded), 1, dtype=torch.float64, device=probs.device,
                            generator=generator)
    for j, row in enumerate(rows):
        gen = row.next_draw_generator()
        if gen is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=gen).to(probs.device)
    pad = (-vocab) % _DRAW_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).reshape(
        n, -1, _DRAW_BLOCK)  # (n, NB, block)
    sums = blocks.sum(dim=-1).to(torch.float64)  # (n, NB)
    cdf = sums.cumsum(dim=-1)  # (n, NB)
    target = u * cdf[:, -1:]  # (n, 1)
    b = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # (n, 1)
    before = cdf.gather(1, (b - 1).clamp(min=0)) * (b > 0)  # (n, 1) mass of earlier blocks
    inside = blocks.gather(1, b.unsqueeze(-1).expand(n, 1, _DRAW_BLOCK)).squeeze(1)
    inside = inside.to(torch.float64).cumsum(dim=-1)  # (n, block) the block's own sums
    at = (target - before) / sums.gather(1, b) * inside[:, -1:]  # (n, 1) within the block
    t = torch.searchsorted(inside, at, right=True).clamp_(max=_DRAW_BLOCK - 1)  # (n, 1)
    tokens = (b * _DRAW_BLOCK + t).squeeze(1).clamp_(max=vocab - 1)  # (n,)
    missed = probs.gather(1, tokens.unsqueeze(1)).squeeze(1) <= 0  # rounding at an edge
    if bool(missed.any()):
        tokens[missed] = probs[missed].argmax(dim=-1)
    return tokens


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   params: Sequence[SamplingParams]) -> list[dict[int, tuple[float, int]]]:
    """logits: (n, V) raw; token_ids: (n,): the logprobs each row's request asked for (its
    token, its `logprobs` most likely and its `logprob_token_ids`), as SampleResult holds them."""
    return _logprob_dicts(logits, token_ids, [p.logprobs for p in params],
                          [p.logprob_token_ids or [] for p in params])


def _logprob_dicts(
    logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int],
    extra_ids: list[list[int]] | None = None,
) -> list[dict[int, tuple[float, int]]]:
    """logits: (n, V) raw; token_ids: (n,). Per row: token_ids[i], the top ks[i] tokens
    (-1: all) and extra_ids[i] (logprob_token_ids) -> (logprob, rank); rank counts the tokens
    with logprob >= its own, like vLLM."""
    vocab = logits.shape[1]
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # (n, V)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # (n, 1)
    ranks = (logprobs >= chosen).sum(dim=-1)  # (n,)
    ks = [vocab if k == -1 else min(k, vocab) for k in ks]
    max_k = max(ks)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_k > 0:
        vals, ids = logprobs.topk(max_k, dim=-1)  # (n, max_k)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out = []
    for i, (token, lp, rank) in enumerate(zip(token_ids.tolist(), chosen.squeeze(1).tolist(),
                                              ranks.tolist())):
        d = {token: (lp, rank)}
        for r in range(ks[i]):
            d[top_ids[i][r]] = (top_vals[i][r], r + 1)
        if extra_ids and extra_ids[i]:
            ids = torch.tensor(extra_ids[i], dtype=torch.long, device=logprobs.device)
            values = logprobs[i, ids]  # (m,)
            extra_ranks = (logprobs[i].unsqueeze(0) >= values.unsqueeze(1)).sum(dim=-1)
            for t, v, rk in zip(extra_ids[i], values.tolist(), extra_ranks.tolist()):
                d.setdefault(t, (v, rk))
        out.append(d)
    return out
