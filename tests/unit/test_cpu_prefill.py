"""The native CPU prefill attention (kernels/csrc/paged_prefill.c) against a float64 torch
reference written here, over shuffled paged caches: whole prompts, chunks after a cached
prefix, tiles that end mid-way; peaked and flat scores; its refusals."""

import pytest
import torch

from pdserve.kernels import cpu_prefill, native
from test_cpu_decode import paged

pytestmark = pytest.mark.skipif(native.load() is None,
                                reason="no C compiler: the native kernels are not built")


def reference(q, k_cache, v_cache, table, context_len, scale):
    """(n, h, d) in float64: the context gathered, scores masked causally by position."""
    n, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    slots = [int(table[t // bs]) * bs + t % bs for t in range(context_len)]
    k = k_cache.reshape(-1, kvh, d)[slots].double().repeat_interleave(h // kvh, 1)  # (L, h, d)
    v = v_cache.reshape(-1, kvh, d)[slots].double().repeat_interleave(h // kvh, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale  # (h, n, L)
    pos = torch.arange(context_len - n, context_len)[:, None]
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def run(h, kvh, d, block_size, new, past, seed=0, spread=1.0, q_scale=1.0):
    k_cache, v_cache, tables = paged([new + past], h, kvh, d, block_size, seed, spread)
    gen = torch.Generator().manual_seed(seed + 1)
    # q rows inside a wider tensor (the model's fused q/k/v view); out rows inside a wider one
    q = torch.randn(new, h + 2 * kvh, d, generator=gen)[:, :h] * q_scale
    wide_out = torch.full((new, h + 1, d), float("nan"))
    out = wide_out[:, :h]
    cpu_prefill.prefill_into(out, q, k_cache, v_cache, tables[0], new + past, d ** -0.5)
    assert wide_out[:, h:].isnan().all()  # nothing written outside the rows' heads
    return out, reference(q, k_cache, v_cache, tables[0], new + past, d ** -0.5)


@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (8, 8, 64), (14, 2, 64), (4, 1, 128),
                                     (8, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("new,past", [(1, 0), (5, 0), (64, 0), (150, 0), (300, 0), (1, 70),
                                      (37, 100), (130, 61)])
def test_matches_reference(h, kvh, d, block_size, new, past):
    out, want = run(h, kvh, d, block_size, new, past)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("spread", [30.0, 0.0])
def test_peaked_and_flat_scores(spread):
    """Large score gaps (softmax near one-hot: the running maximum moves between key tiles)
    and equal scores (uniform) both come out right."""
    out, want = run(6, 2, 64, 16, 140, 30, seed=3, spread=spread, q_scale=3.0)
    # scores of a few hundred carry float32 rounding of ~3e-5 (SDPA's error here is the same)
    torch.testing.assert_close(out.double(), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["block_out_of_range", "negative_block", "more_new_than_context",
                                  "longer_than_table", "nothing_new"])
def test_refuses_sequences_that_do_not_fit(case):
    k_cache, v_cache, tables = paged([40], 4, 2, 64, 16)
    table, new, context = tables[0].clone(), 8, 40
    if case == "block_out_of_range":
        table[2] = k_cache.shape[0]
    elif case == "negative_block":
        table[0] = -1
    elif case == "more_new_than_context":
        new, context = 41, 40
    elif case == "longer_than_table":
        context = table.numel() * 16 + 1
    else:
        new = 0
    q = torch.randn(new, 4, 64)
    with pytest.raises(ValueError, match="prefill attention"):
        cpu_prefill.prefill_into(torch.empty_like(q), q, k_cache, v_cache, table, context,
                                 0.125)
