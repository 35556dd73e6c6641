"""Paged attention in Triton, with the signature of `attention.paged_attention`.

Same cache layout as the torch reference (attention.py): k_cache, v_cache of shape
(num_blocks, block_size, num_kv_heads, head_dim), contiguous; token t of a sequence lives at flat
slot `block_table[t // block_size] * block_size + t % block_size`.

Three kernels, each behind a wrapper that checks the layout it expects and raises a clear
`ValueError` otherwise:

* `write_kv`: one program per token scatters the token's (kvh, d) keys and values into the
  cache at `slot_mapping[token]`. Negative slots are skipped (padding tokens), where the torch
  reference would raise.
* `decode_attention`: one program per (decode sequence, kv head). The program holds the
  sequence's GROUP = h // kvh query heads as the rows of one tile (GQA: each K/V tile is read
  once per group), and walks the context in tiles of `tile_n` tokens; each token's block comes
  from the block table, so a tile may span several (non-contiguous) blocks. Softmax is online, in
  float32.
* `prefill_attention`: one program per (tile of `block_m` new tokens of one prefill, kv head);
  the tile's rows are (token, query head of the group) pairs. Keys and values are always read
  back from the paged cache (the new tokens were written there first), with the causal mask
  offset by the cached prefix: new token i of a span with `past = context_len - num_new` sees
  context positions 0 .. past + i. All prefills of a step go in one launch.

Everything runs in Triton; torch is used only for bookkeeping (allocating the output, building
the small per-tile table for prefills and concatenating the prefills' block tables).

Matmuls use `tl.dot`; float32 inputs use `input_precision="ieee"` (no TF32) so results match the
torch reference closely. float16/bfloat16 inputs accumulate in float32 and round the softmax
probabilities to the input dtype before the P @ V product, as flash attention does.

With TRITON_INTERPRET=1 set before Triton is imported, the kernels run on CPU tensors through
Triton's interpreter (slowly); that is how the unit tests run without a GPU. Otherwise all
tensors must be on a CUDA device.

Not done here: splitting long decode contexts across programs (flash-decoding), autotuning of
tile sizes (the fixed choices below were checked for register spills, never timed: no GPU was
at hand), and skipping the causal mask on tiles that lie fully below the diagonal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention import AttentionMetadata, PrefillSpan
from pdserve.kernels.triton_layout import (
    check_cache,
    check_device,
    check_heads,
    check_index,
    check_qkv,
    decode_config,
    dot_precision,
    fail,
    pow2,
    prefill_config,
)

__all__ = ["decode_attention", "paged_attention", "prefill_attention", "write_kv"]

_LOG2E = 1.4426950408889634


def _interpreted() -> bool:
    # triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set at import time.
    return type(_decode_kernel).__name__ == "InterpretedFunction"


# ---------------------------------------------------------------------------------------------
# Cache write
# ---------------------------------------------------------------------------------------------

@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, D_PAD)
    # A negative slot (padding token) stores nothing: no head is in range. (Written as an int
    # bound: and-ing a block mask with a scalar bool yields an int32 mask in the interpreter.)
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    # The cache is contiguous, so flat slot s sits at s * stride_cs.
    dst = slot * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values. k, v: (T, kvh, d); caches: (num_blocks, block_size, kvh, d).

    Token i goes to flat slot `slot_mapping[i]`; tokens with a negative slot are skipped.
    """
    check_cache(k_cache, v_cache)
    check_qkv("k", k, 3)
    check_qkv("v", v, 3)
    check_index("slot_mapping", slot_mapping, 1)
    check_device(k, v, k_cache, v_cache, slot_mapping, interpreted=_interpreted())
    T, kvh, d = k.shape
    if tuple(v.shape) != (T, kvh, d):
        fail(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if (kvh, d) != tuple(k_cache.shape[2:]):
        fail(f"k (T, kvh, d) = {tuple(k.shape)} does not match cache (kvh, d) = "
              f"{tuple(k_cache.shape[2:])}")
    if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        fail(f"k/v dtypes {k.dtype}/{v.dtype} must equal the cache dtype {k_cache.dtype}")
    if slot_mapping.shape[0] != T:
        fail(f"slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=kvh, H_PAD=pow2(kvh), HEAD_DIM=d, D_PAD=pow2(d),
    )


# ---------------------------------------------------------------------------------------------
# Decode: one query token per sequence
# ---------------------------------------------------------------------------------------------

@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                   token_idx_ptr, block_tables_ptr, seq_lens_ptr,
                   scale_log2,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   stride_cb, stride_cs, stride_ch,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                   IN_PREC: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    token = tl.load(token_idx_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    rows = tl.arange(0, G_PAD)  # query heads of this kv head's group (padded)
    dims = tl.arange(0, D_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # The running max starts finite, so a row with every score masked (-inf) gets alpha = 1 and
    # p = 0 rather than exp(-inf - -inf) = nan.
    m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for start in range(0, seq_len, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=IN_PREC) * scale_log2  # (G_PAD, TILE_N)
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=IN_PREC)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   out: torch.Tensor, token_idx: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, tile_n: int | None) -> None:
    """Decode rows `token_idx` of q (T, h, d) into the same rows of out."""
    check_index("decode_token_idx", token_idx, 1)
    check_index("decode_block_tables", block_tables, 2)
    check_index("decode_seq_lens", seq_lens, 1)
    check_device(q, out, k_cache, v_cache, token_idx, block_tables, seq_lens,
                 interpreted=_interpreted())
    h, kvh, d = check_heads(q, k_cache)
    B = token_idx.shape[0]
    if block_tables.shape[0] != B or seq_lens.shape[0] != B:
        fail(f"decode metadata disagrees: {B} tokens, block tables "
              f"{tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}")
    if B == 0:
        return
    group = h // kvh
    d_pad = pow2(d, 16)  # tl.dot needs every dim >= 16
    default_tile_n, num_warps = decode_config(d_pad, q.dtype)
    tile_n = tile_n or default_tile_n
    if tile_n < 16 or tile_n & (tile_n - 1):
        fail(f"tile_n must be a power of two >= 16, got {tile_n}")
    _decode_kernel[(B, kvh)](
        q, k_cache, v_cache, out, token_idx, block_tables, seq_lens,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, G_PAD=pow2(group, 16), HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_SIZE=k_cache.shape[1], TILE_N=tile_n, IN_PREC=dot_precision(q.dtype),
        num_warps=num_warps,
    )


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     tile_n: int | None = None) -> torch.Tensor:
    """One query per sequence. q: (B, h, d) -> (B, h, d).

    block_tables: (B, max_blocks), each row covering at least ceil(seq_len / block_size) blocks
    (not checked: that would need a device sync); seq_lens: (B,) including the new token.
    `tile_n` (power of two >= 16) is the number of context tokens per loop step.
    """
    check_cache(k_cache, v_cache)
    check_qkv("q", q, 3)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    token_idx = torch.arange(q.shape[0], device=q.device)
    _launch_decode(q, k_cache, v_cache, out, token_idx, block_tables, seq_lens, scale, tile_n)
    return out


# ---------------------------------------------------------------------------------------------
# Prefill: several new tokens per sequence, causal, after an optional cached prefix
# ---------------------------------------------------------------------------------------------

@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tiles_ptr, tables_ptr,
                    scale_log2,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cb, stride_cs, stride_ch,
                    GROUP: tl.constexpr, G_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IN_PREC: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    # Per tile: first query token in the batch, number of valid queries, context position of
    # the first query, context length of the sequence, offset of its block table.
    info = tiles_ptr + tile * 5
    tok0 = tl.load(info + 0)
    n_q = tl.load(info + 1).to(tl.int32)
    pos0 = tl.load(info + 2).to(tl.int32)
    ctx_len = tl.load(info + 3).to(tl.int32)
    table = tables_ptr + tl.load(info + 4)

    rows = tl.arange(0, BLOCK_M * G_PAD)  # row r = (query r // G_PAD, group head r % G_PAD)
    qi = rows // G_PAD
    gh = rows % G_PAD
    row_ok = (qi < n_q) & (gh < GROUP)
    q_pos = pos0 + qi
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    q_off = (tok0 + qi).to(tl.int64)[:, None] * stride_qt \
        + (kv_head * GROUP + gh)[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M * G_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * G_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], dtype=tl.float32)
    end = tl.minimum(ctx_len, pos0 + n_q)  # the last query sees positions < pos0 + n_q
    for start in range(0, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=IN_PREC) * scale_log2  # (rows, BLOCK_N)
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=IN_PREC)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = (tok0 + qi).to(tl.int64)[:, None] * stride_ot \
        + (kv_head * GROUP + gh)[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def _launch_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, spans: list[PrefillSpan], scale: float,
                    block_m: int | None, block_n: int | None) -> None:
    """Attend every span's rows of q (T, h, d) into the same rows of out, in one launch."""
    if not spans:
        return
    h, kvh, d = check_heads(q, k_cache)
    T = q.shape[0]
    block_size = k_cache.shape[1]
    group = h // kvh
    g_pad = pow2(group)
    d_pad = pow2(d, 16)
    rows, default_block_n, num_warps = prefill_config(d_pad, q.dtype)
    block_m = block_m or max(1, rows // g_pad)
    block_n = block_n or default_block_n
    if block_m & (block_m - 1):
        fail(f"block_m must be a power of two, got {block_m}")
    if block_m * g_pad < 16:
        block_m = 16 // g_pad  # tl.dot needs >= 16 rows
    if block_n < 16 or block_n & (block_n - 1):
        fail(f"block_n must be a power of two >= 16, got {block_n}")

    tiles: list[list[int]] = []
    tables: list[torch.Tensor] = []
    table_off = 0
    for i, span in enumerate(spans):
        n = span.num_new
        past = span.context_len - n
        if not 0 <= span.token_start <= span.token_end <= T:
            fail(f"prefill {i}: tokens [{span.token_start}, {span.token_end}) outside the "
                  f"batch of {T}")
        if past < 0:
            fail(f"prefill {i}: context_len {span.context_len} < {n} new tokens")
        bt = span.block_table
        check_index(f"prefills[{i}].block_table", bt, 1)
        if bt.device != q.device:
            fail(f"prefills[{i}].block_table is on {bt.device}, q on {q.device}")
        if bt.shape[0] * block_size < span.context_len:
            fail(f"prefill {i}: {bt.shape[0]} blocks of {block_size} cannot hold "
                  f"context_len {span.context_len}")
        for m0 in range(0, n, block_m):
            tiles.append([span.token_start + m0, min(block_m, n - m0), past + m0,
                          span.context_len, table_off])
        tables.append(bt.to(torch.int64))
        table_off += bt.shape[0]
    if not tiles:
        return
    tile_info = torch.tensor(tiles, dtype=torch.int64).to(q.device, non_blocking=True)
    flat_tables = torch.cat(tables) if len(tables) > 1 else tables[0]
    _prefill_kernel[(len(tiles), kvh)](
        q, k_cache, v_cache, out, tile_info, flat_tables,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, G_PAD=g_pad, HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        IN_PREC=dot_precision(q.dtype), num_warps=num_warps,
    )


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      span: PrefillSpan, scale: float, block_m: int | None = None,
                      block_n: int | None = None) -> torch.Tensor:
    """Causal attention for one sequence's new tokens. q: (n, h, d) -> (n, h, d).

    Unlike the reference, keys/values always come from the cache: the span's new tokens must be
    written there already (as `paged_attention` does). `span.token_start`/`token_end` index q
    here, i.e. they should be 0 and n.
    """
    check_cache(k_cache, v_cache)
    check_qkv("q", q, 3)
    check_device(q, k_cache, v_cache, interpreted=_interpreted())
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch_prefill(q, k_cache, v_cache, out, [span], scale, block_m, block_n)
    return out


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache and attend. q: (T, h, d), k/v: (T, kvh, d).

    Rows of the output that belong to neither a decode nor a prefill are left uninitialised.
    """
    check_cache(k_cache, v_cache)
    check_qkv("q", q, 3)
    check_device(q, k_cache, v_cache, interpreted=_interpreted())
    check_heads(q, k_cache)
    if k.shape[0] != q.shape[0]:
        fail(f"q has {q.shape[0]} tokens, k/v {k.shape[0]}")
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        _launch_decode(q, k_cache, v_cache, out, meta.decode_token_idx,
                       meta.decode_block_tables, meta.decode_seq_lens, scale, None)
    _launch_prefill(q, k_cache, v_cache, out, meta.prefills, scale, None, None)
    return out
