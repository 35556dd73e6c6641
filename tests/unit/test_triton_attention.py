"""Triton paged attention against the torch reference, on CPU through Triton's interpreter.

The interpreter is slow, so shapes stay tiny. It only works when TRITON_INTERPRET=1 is set
before the process first imports triton; when an earlier test module imported it already
(tests/engine import the engine -> models -> kernels.dispatch -> triton), this module runs
itself again in a fresh interpreter process instead (test_in_fresh_process).
"""

import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pdserve.kernels import attention as ref
from pdserve.kernels.attention import AttentionMetadata, PrefillSpan

ta = pytest.importorskip("pdserve.kernels.triton_attention",
                         reason="pdserve.kernels.triton_attention does not import")

INTERPRETED = ta._interpreted()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported without TRITON_INTERPRET=1 in this process; "
    "test_in_fresh_process runs these tests instead")


@pytest.mark.skipif(INTERPRETED, reason="the tests below run in this process")
def test_in_fresh_process():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(Path(__file__).resolve())], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "test_in_fresh_process runs these" not in r.stdout, \
        r.stdout[-2000:]


TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-4}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}
NUM_BLOCKS = 24


def _caches(block_size, kvh, d, dtype, gen):
    shape = (NUM_BLOCKS, block_size, kvh, d)
    return (torch.randn(shape, generator=gen).to(dtype),
            torch.randn(shape, generator=gen).to(dtype))


def _tables(lengths, block_size, gen):
    """Disjoint, shuffled (non-contiguous) block tables for sequences of the given lengths."""
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    tables, used = [], 0
    for n in lengths:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb].clone())
        used += nb
    assert used <= NUM_BLOCKS
    return tables


def _slot(table, pos, block_size):
    return int(table[pos // block_size]) * block_size + pos % block_size


def _batch(decode_lens, prefills, h, kvh, d, block_size, dtype, seed=0):
    """A mixed step: decodes (context lengths incl. the new token) first, then prefills given as
    (num_new, context_len). Returns q, k, v, caches and the metadata."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = _caches(block_size, kvh, d, dtype, gen)
    tables = _tables(list(decode_lens) + [c for _, c in prefills], block_size, gen)
    T = len(decode_lens) + sum(n for n, _ in prefills)
    q = torch.randn(T, h, d, generator=gen).to(dtype)
    k = torch.randn(T, kvh, d, generator=gen).to(dtype)
    v = torch.randn(T, kvh, d, generator=gen).to(dtype)

    slots = []
    for i, n in enumerate(decode_lens):
        slots.append(_slot(tables[i], n - 1, block_size))
    max_blocks = max([t.numel() for t in tables[:len(decode_lens)]], default=1) + 1
    dec_tables = torch.zeros(len(decode_lens), max_blocks, dtype=torch.int64)
    for i in range(len(decode_lens)):
        dec_tables[i, :tables[i].numel()] = tables[i]

    spans, tok = [], len(decode_lens)
    for j, (n, ctx) in enumerate(prefills):
        table = tables[len(decode_lens) + j]
        slots += [_slot(table, p, block_size) for p in range(ctx - n, ctx)]
        spans.append(PrefillSpan(tok, tok + n, ctx, table))
        tok += n

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        decode_token_idx=torch.arange(len(decode_lens), dtype=torch.int64),
        decode_block_tables=dec_tables,
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int64),
        prefills=spans,
    )
    return q, k, v, k_cache, v_cache, meta


def _reference(q, k, v, k_cache, v_cache, meta, scale):
    """The torch reference in float32 (float16 matmuls are slow or missing on CPU)."""
    f = [t.float() for t in (q, k, v, k_cache, v_cache)]
    out = ref.paged_attention(*f, meta, scale)
    return out, f[3], f[4]


@needs_interpreter
def test_write_kv_matches_index_copy():
    gen = torch.Generator().manual_seed(1)
    kvh, d, bs = 2, 16, 4
    k_cache, v_cache = _caches(bs, kvh, d, torch.float32, gen)
    # k, v as strided views of a fused projection, as a model would produce them.
    kv = torch.randn(5, 2, kvh, d, generator=gen)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([7, 0, 93, 40, 41], dtype=torch.int64)
    rk, rv = k_cache.clone(), v_cache.clone()
    ref.write_kv(rk, rv, k, v, slots)
    ta.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, rk) and torch.equal(v_cache, rv)

    # Negative slots (padding) are skipped.
    before = k_cache.clone()
    ta.write_kv(k_cache, v_cache, k[:2] + 1, v[:2] + 1, torch.tensor([-1, 3]))
    assert torch.equal(k_cache.view(-1, kvh, d)[3], k[1] + 1)
    mask = torch.ones(k_cache.view(-1, kvh, d).shape[0], dtype=torch.bool)
    mask[3] = False
    assert torch.equal(k_cache.view(-1, kvh, d)[mask], before.view(-1, kvh, d)[mask])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d,block_size", [(16, 4), (32, 8)])
def test_decode_matches_reference(dtype, d, block_size):
    h, kvh = 4, 2
    lens = [1, 5, 19, 9]  # one token, part of a block, several blocks
    q, k, v, k_cache, v_cache, meta = _batch(lens, [], h, kvh, d, block_size, dtype, seed=d)
    scale = d ** -0.5
    expected, rk, rv = _reference(q, k, v, k_cache, v_cache, meta, scale)
    out = ta.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(k_cache.float(), rk, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.float(), rv, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@needs_interpreter
def test_decode_attention_multi_tile():
    """tile_n=16 with a 19-token context: two tiles, the second straddling blocks."""
    h, kvh, d, bs = 4, 2, 16, 4
    q, k, v, k_cache, v_cache, meta = _batch([19, 3], [], h, kvh, d, bs, torch.float32, seed=3)
    ref.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    args = (q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, 0.25)
    out = ta.decode_attention(*args, tile_n=16)
    torch.testing.assert_close(out, ref.decode_attention(*args), **TOL[torch.float32])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch_prefill_with_and_without_prefix(dtype):
    h, kvh, d, bs = 4, 2, 16, 4
    # Two decodes, a fresh prefill, and a prefill after a 7-token cached prefix.
    q, k, v, k_cache, v_cache, meta = _batch([6, 11], [(5, 5), (6, 13)], h, kvh, d, bs, dtype,
                                             seed=7)
    scale = d ** -0.5
    expected, rk, rv = _reference(q, k, v, k_cache, v_cache, meta, scale)
    out = ta.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(k_cache.float(), rk, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.float(), rv, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@needs_interpreter
def test_prefill_tiles_and_gqa_group_of_four():
    """Small block_m/block_n so a span spans several query and key tiles; 4 q heads on 1 kv."""
    h, kvh, d, bs = 4, 1, 32, 8
    q, k, v, k_cache, v_cache, meta = _batch([], [(9, 21)], h, kvh, d, bs, torch.float32,
                                             seed=11)
    ref.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    span = meta.prefills[0]
    expected = ref.prefill_attention(q, k, v, k_cache, v_cache, span, 0.2)
    out = ta.prefill_attention(q, k_cache, v_cache, span, 0.2, block_m=4, block_n=16)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@needs_interpreter
def test_int32_metadata_and_fused_qkv_views():
    """int32 index tensors, and q/k/v as strided views of one fused projection output."""
    h, kvh, d, bs = 4, 2, 16, 8
    q, k, v, k_cache, v_cache, meta = _batch([10], [(3, 12)], h, kvh, d, bs, torch.float32,
                                             seed=5)
    scale = d ** -0.5
    expected, _, _ = _reference(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # (T, (h + 2kvh) d)
    qv = qkv[:, :h * d].view(-1, h, d)
    kv_ = qkv[:, h * d:(h + kvh) * d].view(-1, kvh, d)
    vv = qkv[:, (h + kvh) * d:].view(-1, kvh, d)
    assert not qv.is_contiguous()
    meta.slot_mapping = meta.slot_mapping.int()
    meta.decode_token_idx = meta.decode_token_idx.int()
    meta.decode_block_tables = meta.decode_block_tables.int()
    meta.decode_seq_lens = meta.decode_seq_lens.int()
    for span in meta.prefills:
        span.block_table = span.block_table.int()
    out = ta.paged_attention(qv, kv_, vv, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@needs_interpreter
def test_write_kv_bfloat16():
    """bfloat16 stores are exact. (The interpreter's tl.dot mishandles bfloat16 on CPU as of
    Triton 3.9, so bfloat16 attention is only checked on a GPU.)"""
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = _caches(4, 2, 16, torch.bfloat16, gen)
    k = torch.randn(3, 2, 16, generator=gen).bfloat16()
    v = torch.randn(3, 2, 16, generator=gen).bfloat16()
    slots = torch.tensor([5, 60, 17])
    rk, rv = k_cache.clone(), v_cache.clone()
    ref.write_kv(rk, rv, k, v, slots)
    ta.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, rk) and torch.equal(v_cache, rv)


@needs_interpreter
def test_layout_errors():
    h, kvh, d, bs = 4, 2, 16, 4
    q, k, v, k_cache, v_cache, meta = _batch([3], [], h, kvh, d, bs, torch.float32)
    with pytest.raises(ValueError, match="must be contiguous"):
        ta.paged_attention(q, k, v, k_cache.transpose(2, 3), v_cache, meta, 1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ta.paged_attention(q[:, :3], k, v, k_cache, v_cache, meta, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        ta.paged_attention(q.half(), k, v, k_cache, v_cache, meta, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        ta.paged_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, k_cache,
                           v_cache, meta, 1.0)
    with pytest.raises(ValueError, match="int32 or int64"):
        ta.write_kv(k_cache, v_cache, k, v, meta.slot_mapping.float())
