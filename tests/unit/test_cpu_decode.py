"""The native CPU decode attention (kernels/csrc/paged_decode.c) against a float64 torch
reference written here, over shuffled paged caches; its refusals; the torch fallback."""

import pytest
import torch

from pdserve.cache_dir import CACHE_ENV
from pdserve.kernels import attention, cpu_decode, native
from pdserve.kernels.attention import AttentionMetadata, PrefillSpan

pytestmark = pytest.mark.skipif(native.load() is None,
                                reason="no C compiler: the native kernels are not built")


def reference(q, k_cache, v_cache, tables, lens, scale):
    """(B, h, d) in float64: each sequence's keys gathered and attended densely."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = []
    for b, n in enumerate(lens):
        slots = [int(tables[b][t // bs]) * bs + t % bs for t in range(n)]
        k = k_cache.reshape(-1, kvh, k_cache.shape[3])[slots].double()  # (n, kvh, d)
        v = v_cache.reshape(-1, kvh, v_cache.shape[3])[slots].double()
        group = q.shape[1] // kvh
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (n, h, d)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def paged(lens, h, kvh, d, block_size, seed=0, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in lens]
    num_blocks = sum(nbs) + 3
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen) * spread
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(nbs)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for b, nb in enumerate(nbs):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
    return k_cache, v_cache, tables


@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (8, 8, 64), (14, 2, 64), (4, 1, 128),
                                     (8, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(h, kvh, d, block_size):
    lens = [1, 15, 16, 17, 33, 47, 130]
    k_cache, v_cache, tables = paged(lens, h, kvh, d, block_size)
    gen = torch.Generator().manual_seed(1)
    # q rows inside a wider tensor (as the model's fused q/k view), decodes at scattered rows
    wide = torch.randn(12, h + kvh, d, generator=gen)
    q = wide[:, :h]
    rows = torch.tensor([3, 0, 11, 5, 7, 2, 9])
    out = torch.full((12, h, d), float("nan"))
    cpu_decode.decode_into(out, q, k_cache, v_cache, tables, torch.tensor(lens), rows, d ** -0.5)
    want = reference(q[rows], k_cache, v_cache, tables, lens, d ** -0.5)
    torch.testing.assert_close(out[rows].double(), want, atol=2e-6, rtol=1e-5)
    untouched = [r for r in range(12) if r not in rows.tolist()]
    assert out[untouched].isnan().all()


@pytest.mark.parametrize("d", [64, 128])
def test_runs_of_one_sequence_match_reference(d):
    """Decodes that follow each other in row, length and first block (a sequence's token and
    its drafts, ngram_drafts.py) run as one item per KV head; each still gets its own
    causal context: row i of a run sees one key more than row i - 1."""
    h, kvh, bs = 9, 3, 16
    k_cache, v_cache, tables = paged([70, 33], h, kvh, d, bs, seed=7)
    # sequence 0: rows 0-3 at lengths 67-70 (a run); sequence 1: rows 4-5 at 32-33 (a run);
    # row 6: sequence 0 again at length 40, alone (its length does not follow)
    lens = [67, 68, 69, 70, 32, 33, 40]
    which = [0, 0, 0, 0, 1, 1, 0]
    q = torch.randn(7, h, d, generator=torch.Generator().manual_seed(8))
    out = torch.empty_like(q)
    cpu_decode.decode_into(out, q, k_cache, v_cache, tables[which], torch.tensor(lens),
                           torch.arange(7), d ** -0.5)
    want = reference(q, k_cache, v_cache, tables[which], lens, d ** -0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)


def test_peaked_and_flat_scores():
    """Large score gaps (softmax near one-hot) and equal scores (uniform) both come out right:
    the kernel's own exponential holds over the whole range."""
    lens = [40, 300]
    for spread in (30.0, 0.0):
        k_cache, v_cache, tables = paged(lens, 6, 2, 64, 16, seed=3, spread=spread)
        q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(4)) * 3
        out = torch.empty_like(q)
        cpu_decode.decode_into(out, q, k_cache, v_cache, tables, torch.tensor(lens),
                               torch.arange(2), 0.125)
        want = reference(q, k_cache, v_cache, tables, lens, 0.125)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-4)


def test_mixed_step_matches_explicit_path():
    """paged_attention with decodes (native) and prefills in one step equals the explicit-
    score path (`masked_attention`, no window, no softcap) for every token."""
    h, kvh, d, bs = 9, 3, 64, 16
    lens = [20, 64, 5]
    prefill_ctx, prefill_new = 40, 24
    k_cache, v_cache, tables = paged(lens + [prefill_ctx], h, kvh, d, bs, seed=5)
    gen = torch.Generator().manual_seed(6)
    T = len(lens) + prefill_new
    q, k, v = (torch.randn(T, n, d, generator=gen) for n in (h, kvh, kvh))
    slots = [int(tables[b][(n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens)]
    p_table = tables[3]
    slots += [int(p_table[p // bs]) * bs + p % bs
              for p in range(prefill_ctx - prefill_new, prefill_ctx)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), decode_token_idx=torch.arange(3),
        decode_block_tables=tables[:3], decode_seq_lens=torch.tensor(lens),
        prefills=[PrefillSpan(3, T, prefill_ctx, p_table)])
    out = attention.paged_attention(q, k, v, k_cache, v_cache, meta, d ** -0.5)
    for b, n in enumerate(lens):
        want = attention.masked_attention(q[b:b + 1], k_cache, v_cache, tables[b], n,
                                          d ** -0.5, None, None)
        torch.testing.assert_close(out[b:b + 1], want, atol=2e-5, rtol=1e-4)
    want = attention.masked_attention(q[3:], k_cache, v_cache, p_table, prefill_ctx,
                                      d ** -0.5, None, None)
    torch.testing.assert_close(out[3:], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["block_out_of_range", "negative_block", "zero_length",
                                  "longer_than_table"])
def test_refuses_decodes_that_do_not_fit(case):
    k_cache, v_cache, tables = paged([20, 20], 4, 2, 64, 16)
    lens = torch.tensor([20, 20])
    if case == "block_out_of_range":
        tables[1, 1] = k_cache.shape[0]
    elif case == "negative_block":
        tables[1, 0] = -1
    elif case == "zero_length":
        lens[1] = 0
    else:
        lens[1] = tables.shape[1] * 16 + 1
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="decode 1"):
        cpu_decode.decode_into(torch.empty_like(q), q, k_cache, v_cache, tables, lens,
                               torch.arange(2), 0.125)


def test_unsupported_shapes_take_the_torch_path():
    q = torch.randn(2, 4, 32)
    k_cache = torch.zeros(4, 16, 2, 32)
    assert not cpu_decode.supports(q, k_cache, k_cache)  # head size 32
    q = torch.randn(2, 4, 64, dtype=torch.float64)
    k_cache = torch.zeros(4, 16, 2, 64, dtype=torch.float64)
    assert not cpu_decode.supports(q, k_cache, k_cache)  # float64


def test_without_a_compiler_the_torch_kernels_serve(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    native.load.cache_clear()
    try:
        assert native.load() is None
        q = torch.randn(1, 4, 64)
        assert not cpu_decode.supports(q, torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64))
    finally:
        native.load.cache_clear()


def test_build_is_cached_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load() is not None
        built = list(tmp_path.glob("native-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        native.load.cache_clear()
        assert native.load() is not None
        assert [p.stat().st_mtime_ns for p in tmp_path.glob("native-*.so")] == [stamp]
    finally:
        native.load.cache_clear()
