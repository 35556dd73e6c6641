"""Chooses the attention implementation for the tensors' device.

CPU tensors use the torch reference in attention.py; CUDA tensors use the Triton kernels when
Triton is importable (kernels/triton_attention.py), with the same signature. Triton is
imported at the first CUDA call: a CPU process never loads it.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from pdserve.kernels import attention as reference
from pdserve.kernels.attention import AttentionMetadata


@functools.cache
def triton_kernels() -> ModuleType | None:
    """kernels/triton_attention, or None where Triton does not import (the reference then
    serves every device)."""
    try:
        from pdserve.kernels import triton_attention
    except ImportError:
        return None
    return triton_attention


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    softcap: float | None = None, sliding_window: int | None = None
                    ) -> torch.Tensor:
    """Write K/V into the cache and attend, on the best implementation for `q.device`.

    Attention soft-capping and sliding windows (Gemma) are not in the Triton kernels: with
    either set, CUDA tensors fall back to the torch path too (slower, but correct)."""
    if softcap is not None or sliding_window is not None:
        return reference.paged_attention(q, k, v, k_cache, v_cache, meta, scale,
                                         softcap=softcap, sliding_window=sliding_window)
    kernels = triton_kernels() if q.is_cuda else None
    return (kernels or reference).paged_attention(q, k, v, k_cache, v_cache, meta, scale)
