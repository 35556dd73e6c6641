"""Greedy decoding's argmax over a step's logits, through the native kernel (csrc/argmax.c)
where it serves: float32 CPU rows that are contiguous. The same indices as torch.argmax (ties
to the first, a NaN counts as the largest); anything else takes torch's."""

from __future__ import annotations

import torch

from pdserve.kernels import native


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits: (B, V) -> (B,) int64, the first index of each row's largest value."""
    if (logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype != torch.float32
            or logits.stride(1) != 1 or logits.shape[1] == 0):
        return logits.argmax(dim=-1)
    lib = native.load()  # after the checks: an engine on another device never builds it here
    if lib is None:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.long, device="cpu")
    lib.argmax_rows_f32(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                        out.data_ptr(), torch.get_num_threads())
    return out
