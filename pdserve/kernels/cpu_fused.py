"""Fused elementwise layers on CPU through the native kernels (csrc/elementwise.c), with the
torch expressions they replace as the fallback: RMSNorm, residual add + RMSNorm, SiLU-and-mul
and the rotary embedding. The native path serves float32 CPU tensors whose rows are
contiguous; anything else takes the torch path, with the same results up to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import native


def _native_rows(*tensors: torch.Tensor) -> bool:
    """2-D float32 CPU tensors with contiguous rows, and the library built."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2
                and t.stride(1) == 1 for t in tensors)
            and native.load() is not None)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (T, n) -> x / sqrt(mean(x^2) + eps) * weight, (T, n)."""
    if not (_native_rows(x) and weight.dtype == torch.float32 and weight.is_contiguous()):
        return torch_rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    native.load().rms_norm_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                               out.stride(0), x.shape[0], x.shape[1], eps,
                               torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)); x: (T, n), updated in place where the native
    kernel serves (x must then be a tensor of the caller's own, not a view of another)."""
    if not (_native_rows(x, delta) and weight.dtype == torch.float32
            and weight.is_contiguous()):
        x = x + delta
        return x, torch_rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    native.load().add_rms_norm_f32(x.data_ptr(), x.stride(0), delta.data_ptr(),
                                   delta.stride(0), weight.data_ptr(), out.data_ptr(),
                                   out.stride(0), x.shape[0], x.shape[1], eps,
                                   torch.get_num_threads())
    return x, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2n) -> silu(gate) * up, (T, n)."""
    if not _native_rows(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype)
    native.load().silu_mul_f32(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(),
                               out.stride(0), rows, n, torch.get_num_threads())
    return out


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, d); cos, sin: (T, 1, d/2) -> rotated (half-split layout), same dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def can_rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x: (T, heads, d) whose heads are contiguous within each row (a view of a projection's
    output is fine); cos, sin: (T, 1, d/2) contiguous."""
    return (x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and x.shape[2] % 2 == 0 and cos.is_contiguous() and sin.is_contiguous()
            and cos.numel() == sin.numel() == x.shape[0] * x.shape[2] // 2
            and native.load() is not None)


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`torch_rotary`, written back into x: (T, heads, d); cos, sin: (T, 1, d/2);
    `can_rotate_in_place(x, cos, sin)` must hold."""
    native.load().rotary_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2],
                             cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
