"""Prefill attention on CPU through the native kernel (csrc/paged_prefill.c).

A sequence's new tokens attend causally over its whole context, read straight from the cache
blocks (the new keys and values are written there first), flash-style: the scores live in
registers a tile at a time, never as a matrix. Serves float32 caches on CPU with head sizes
64 and 128 (`supports` says when); SDPA in attention.py serves the rest.
"""

from __future__ import annotations

import torch

from pdserve.kernels import native
from pdserve.kernels.cpu_decode import supports  # the same layouts and dtypes

__all__ = ["prefill_into", "supports"]


def prefill_into(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                 scale: float) -> None:
    """out = causal attention of the last n = q.shape[0] tokens of a sequence over its
    `context_len` tokens in the cache (blocks `block_table`). q, out: (n, h, d), rows of any
    stride, heads contiguous; caches: (num_blocks, block_size, kvh, d). Raises ValueError when
    the sequence does not fit its block table or the cache."""
    assert out.shape == q.shape and out.stride(-1) == 1 and out.stride(-2) == q.shape[-1]
    table = block_table.to(torch.int64).contiguous()
    num_blocks, block_size, kvh, d = k_cache.shape
    n, h = q.shape[0], q.shape[1]
    code = native.load().paged_prefill_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
        block_size, kvh, d, table.data_ptr(), table.numel(), n, context_len, h, scale,
        out.data_ptr(), out.stride(0), torch.get_num_threads())
    if code == -1:
        raise ValueError(f"prefill attention: head size {d} with {h} query and {kvh} KV heads "
                         f"is not supported by the native kernel")
    if code == -2:
        raise MemoryError("prefill attention: no memory for the kernel's scratch")
    if code < 0:
        raise ValueError(f"prefill attention: {n} new tokens in a context of {context_len} do "
                         f"not fit the block table of {table.numel()} blocks or the cache of "
                         f"{num_blocks} blocks")
