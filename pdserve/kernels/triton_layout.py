"""Argument checks and launch configurations of the Triton paged-attention kernels
(triton_attention.py): each check raises a ValueError naming what is wrong."""

from __future__ import annotations

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def fail(what: str) -> None:
    raise ValueError(f"triton paged attention: {what}")


def check_device(*tensors: torch.Tensor, interpreted: bool) -> None:
    """One device for all; CUDA unless the kernels run in Triton's interpreter."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            fail(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type != "cuda" and not interpreted:
        fail(f"tensors must be on a CUDA device (got {device}); CPU tensors only run under "
              "TRITON_INTERPRET=1 set before Triton is imported")


def check_qkv(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        fail(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        fail(f"{name} dtype must be float16, bfloat16 or float32, got {t.dtype}")
    if t.stride(-1) != 1:
        fail(f"{name} must be contiguous in its last (head_dim) dim, got strides {t.stride()}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            fail(f"{name} must be (num_blocks, block_size, num_kv_heads, head_dim), "
                  f"got shape {tuple(c.shape)}")
        if not c.is_contiguous():
            fail(f"{name} must be contiguous")
        if c.dtype not in FLOAT_DTYPES:
            fail(f"{name} dtype must be float16, bfloat16 or float32, got {c.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        fail(f"k_cache and v_cache differ: {tuple(k_cache.shape)} {k_cache.dtype} vs "
              f"{tuple(v_cache.shape)} {v_cache.dtype}")


def check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        fail(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        fail(f"{name} dtype must be int32 or int64, got {t.dtype}")
    if t.stride(-1) != 1 and t.numel() > 1:
        fail(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_heads(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    """(h, kvh, head_dim), checked between q (.., h, d) and the cache."""
    h, d = q.shape[-2], q.shape[-1]
    kvh, cd = k_cache.shape[2], k_cache.shape[3]
    if d != cd:
        fail(f"q head_dim {d} != cache head_dim {cd}")
    if kvh == 0 or h % kvh:
        fail(f"query heads ({h}) must be a multiple of kv heads ({kvh})")
    if q.dtype != k_cache.dtype:
        fail(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    return h, kvh, d


def pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(max(1, n)))


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # the latter is ignored for 16-bit inputs


# Tile sizes and warps. Not autotuned nor timed: chosen so that the kernels compile for sm_90
# without register spills (checked with ptxas -v through triton.compile, no GPU needed).
def decode_config(d_pad: int, dtype: torch.dtype) -> tuple[int, int]:
    """(context tokens per loop step, num_warps)."""
    if d_pad > 128:
        return 16, 8
    if dtype == torch.float32:
        return (32, 4) if d_pad <= 64 else (16, 4)
    return (64, 4) if d_pad <= 64 else (32, 4)


def prefill_config(d_pad: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(rows per program = query tokens x group heads, keys per loop step, num_warps)."""
    if d_pad > 128:
        return (16, 16, 8) if dtype == torch.float32 else (32, 32, 8)
    rows = 32 if dtype == torch.float32 else 64
    return rows, 32, 4 if d_pad <= 64 else 8
