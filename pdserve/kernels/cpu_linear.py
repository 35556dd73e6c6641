"""Linear layers whose weights are also packed once for oneDNN, the CPU's GEMM library.

`F.linear` hands MKL the row-major (out, in) weight at every call; from 4 to a few dozen rows
(a decode step's handful of sequences) MKL then runs well below the memory bandwidth that
reading the weights needs. oneDNN's blocked weight layout, made once at load time, runs those
shapes 20-35% faster in float32 and large prefill batches about as fast; for 1-3 rows MKL's
matrix-vector path on the plain weight is faster still (benchmarks/linear_cpu.py). So the
layer keeps both layouts, which doubles the memory of its weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_MIN_ROWS = 4  # below this, the plain weight is faster


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing applies to float32 weights on CPU, where torch was built with it."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    """y = x W^T + b on the plain or the packed weight, by row count; x: (T, in) -> (T, out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """weight: (out, in), shared (not copied) and packed; bias: (out,) or None."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.register_buffer("packed_weight",
                             torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < PACKED_MIN_ROWS:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                  [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module) -> int:
    """Replace every packable `nn.Linear` under `model` by a PackedLinear, in place, once
    its weights are loaded; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and can_pack(child.weight):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced
