"""Linear layers whose float32 CPU weights are packed once, at load time, for a faster GEMM.

`F.linear` hands MKL the row-major (out, in) weight at every call, and for the few rows of a
decode step MKL runs far below the memory bandwidth that reading the weights needs. Two packed
layouts serve instead (benchmarks/linear_cpu.py has the numbers):

- **panels** (the default where the native kernels build): panels of 32 outputs, k-major, for
  `csrc/linear.c`. A decode step streams each weight once at memory speed (on SmolLM2's
  shapes 1.2x oneDNN from 4 to 64 rows, 2.3x MKL at 1 row), prefill batches run level with
  oneDNN, and a row's result does not depend on the other rows of the batch. Where the weight
  is exactly 8-bit (or 4-bit) codes times a scale plus an offset per 32 inputs (a GGUF Q4/Q8
  checkpoint) or bfloat16 values (a bf16 checkpoint), `coded_weights.py` keeps that form too,
  and steps of up to coded_max_rows() rows stream it instead (`csrc/linear_coded.c`: the same
  results bit for bit in a third, a sixth or half the bytes).
- **onednn**: oneDNN's blocked layout, 20-35% faster than F.linear from 4 to a few dozen rows,
  with MKL's matrix-vector path on the plain weight below 4 rows.

Either way the layer keeps the plain weight too (shared with the model, e.g. a tied embedding),
so its weights take twice their memory (and 0.63 to 2 bytes per weight more where coded).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import native

PANEL = 32  # outputs per panel of csrc/linear.c's layout
ONEDNN_MIN_ROWS = 4  # below this, MKL on the plain weight beats oneDNN's layout
# Up to this many rows, coded weights (linear_coded.c) beat the panels. With 16 lanes
# (AVX-512): 4-bit codes by 1.14x at 32 rows, 8-bit by 1.07x, level from 48. With 8 (AVX2):
# 4-bit by 1.14x at 16 rows but 0.96x at 32, bfloat16 level at 16 and 0.82x at 32
# (results/linear_cpu.md, "Kernels on 8 lanes"). With 4 (SSE on x86) they took longer than
# the panels at every row count up to 32, so 4-lane builds keep to the panels ("Kernels on 4
# lanes").
CODED_MAX_ROWS = 32
CODED_MAX_ROWS_BY_LANES = {16: CODED_MAX_ROWS, 8: 16, 4: 0}


@functools.cache
def coded_max_rows() -> int:
    """The most rows a step runs on coded weights, for the native build's vector width (0:
    none, and layers keep no coded form)."""
    lib = native.load()
    return 0 if lib is None else CODED_MAX_ROWS_BY_LANES[lib.vector_lanes()]


def can_pack(weight: torch.Tensor) -> bool:
    """Packing applies to float32 weights on CPU, where the native kernels or oneDNN exist."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and (native.load() is not None or torch.backends.mkldnn.is_available()))


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (ceil(out / 32), in, 32), zero past `out`: panel p, row k holds outputs
    32p .. 32p + 31 of input k. Any dtype (coded weights use it for their codes)."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, in_features)
    padded[:out_features] = weight
    return padded.view(num_panels, PANEL, in_features).transpose(1, 2).contiguous()


class PackedLinear(nn.Module):
    """y = x W^T + b on a packed weight; x: (T, in) -> (T, out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 layout: str | None = None):
        """weight: (out, in), shared (not copied) and packed; bias: (out,) or None; layout:
        "panels" or "onednn", by default panels where the native kernels are built."""
        super().__init__()
        self.layout = layout or ("panels" if native.load() is not None else "onednn")
        if self.layout not in ("panels", "onednn"):
            raise ValueError(f"layout must be 'panels' or 'onednn', not {self.layout!r}")
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(),
                             persistent=False)
        packed = (pack_panels(weight) if self.layout == "panels"
                  else torch.ops.mkldnn._reorder_linear_weight(weight, None))
        self.register_buffer("packed_weight", packed, persistent=False)
        from pdserve.kernels.coded_weights import encode  # it imports this module's layout

        coded = encode(weight) if self.layout == "panels" and coded_max_rows() else None
        self.register_buffer("codes", None if coded is None else coded.codes,
                             persistent=False)
        self.register_buffer("code_params", None if coded is None else coded.params,
                             persistent=False)
        self.code_bits = 0 if coded is None else coded.bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "panels":
            if x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu":
                return self._panels(x)
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] < ONEDNN_MIN_ROWS:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                  [], "")

    def _panels(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.in_features:  # the kernel would read past the rows
            raise ValueError(f"linear: input has {x.shape[1]} features, the layer takes "
                             f"{self.in_features}")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        bias = None if self.bias is None else self.bias.data_ptr()
        if self.codes is not None and x.shape[0] <= coded_max_rows():
            native.load().linear_coded_f32(
                x.data_ptr(), x.stride(0), x.shape[0], self.codes.data_ptr(),
                None if self.code_params is None else self.code_params.data_ptr(),
                self.code_bits, self.out_features, self.in_features, bias, out.data_ptr(),
                out.stride(0), torch.get_num_threads())
            return out
        native.load().linear_f32(x.data_ptr(), x.stride(0), x.shape[0],
                                 self.packed_weight.data_ptr(), self.out_features,
                                 self.in_features, bias, out.data_ptr(), out.stride(0),
                                 torch.get_num_threads())
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"layout={self.layout}, coded={self.codes is not None}")


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
