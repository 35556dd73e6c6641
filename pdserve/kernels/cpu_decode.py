"""Decode attention on CPU through the native kernel (csrc/paged_decode.c).

Each decode's query heads read their keys and values straight from the cache blocks: no
gathered copy, no CSR pattern or index tensors built per step. It serves float32 caches on
CPU with head sizes 64 and 128; `supports` says when, and the torch path in attention.py
serves the rest.
"""

from __future__ import annotations

import torch

from pdserve.kernels import native

HEAD_SIZES = (64, 128)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == v_cache.dtype == torch.float32
            and q.shape[-1] in HEAD_SIZES and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1]
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and native.load() is not None)


def decode_into(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                rows: torch.Tensor, scale: float) -> None:
    """out[rows[b]] = attention of q[rows[b]] over decode b's context (seq_lens[b] tokens,
    blocks block_tables[b]). q: (T, h, d) with rows of any stride; out: (T, h, d)
    contiguous; caches: (num_blocks, block_size, kvh, d); block_tables: (B, max_blocks),
    seq_lens, rows: (B,), int64. Raises ValueError for a decode that does not fit the cache."""
    assert out.is_contiguous() and out.shape == q.shape
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    rows = rows.to(torch.int64).contiguous()
    num_blocks, block_size, kvh, d = k_cache.shape
    code = native.load().paged_decode_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
        block_size, kvh, d, tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        rows.data_ptr(), rows.numel(), q.shape[1], scale, out.data_ptr(),
        torch.get_num_threads())
    if code == -1:
        raise ValueError(f"decode attention: head size {d} with {q.shape[1]} query and {kvh} "
                         f"KV heads is not supported by the native kernel")
    if code == -2:
        raise MemoryError("decode attention: no memory for the scores")
    if code < 0:
        b = -3 - code
        raise ValueError(f"decode attention: decode {b} (length {int(lens[b])}) does not fit "
                         f"its block table or the cache of {num_blocks} blocks")
