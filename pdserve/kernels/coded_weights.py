"""Float32 weights held in fewer bytes that give back their float32 values exactly.

Two forms, found from the float32 values alone and proved value by value at load:

- **8-bit codes.** A block-quantized checkpoint (GGUF's Q4_0, Q4_1 and Q8_0: the bundled
  SmolLM2 is Q4_1 with a Q8_0 embedding) is dequantized to float32, and the model computes in
  float32 with those values. Each run of 32 inputs of an output row is then `scale * code +
  offset` with a float16 scale and small integer codes, so about a quarter of the bytes hold
  the same weight. A run is coded only where the kernel's own rebuilding gives every value
  back bit for bit (csrc/linear_coded.c's `code_runs_f32`). Where every code of a weight lies
  in 0 .. 15 and every scale and offset is a float16 value (GGUF's Q4_1), the codes are held
  two to a byte and the scales and offsets as float16: half the bytes again, rebuilt to the
  same values (a scale times a code below 16 is exact in float32, so one rounding either way).
- **bfloat16.** A bf16 checkpoint (most on the Hugging Face hub) computed in float32, as a CPU
  engine does by default: every value's lower 16 bits are zero, so half the bytes hold it.

A weight in neither form (random float32, say) gets None and keeps the float32 path, as does
every weight with `PDSERVE_CODED_WEIGHTS=0` (the coded form is kept beside the float32 panels:
0.63 to 2 bytes per weight more).
csrc/linear_coded.c's kernel streams these instead of the float32 panels; the layouts here
match its comment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pdserve.kernels import native
from pdserve.kernels.cpu_linear import PANEL, pack_panels

DISABLE_ENV = "PDSERVE_CODED_WEIGHTS"
RUN = 32  # inputs per scale and offset


@dataclass(frozen=True)
class CodedWeight:
    """8-bit codes: codes (ceil(out / 32), in, 32) int8 and params (ceil(out / 32), in / 32, 2,
    32) float32, the scales then the offsets of each panel's 32 outputs for each run of 32
    inputs. 4-bit codes: codes (ceil(out / 32), in, 16) uint8, byte j holding output j's code
    in its low half and output j + 16's in its high half, and the same params in float16.
    bfloat16: codes (ceil(out / 32), in, 32) int16, the values' upper halves, and params
    None."""

    codes: torch.Tensor
    params: torch.Tensor | None

    @property
    def bits(self) -> int:
        """The kernel's name for the form: 8, 4 or 16."""
        return {torch.int8: 8, torch.uint8: 4, torch.int16: 16}[self.codes.dtype]


def _half(x: torch.Tensor) -> list[torch.Tensor]:
    """x rounded to float16, and its two float16 neighbours (x >= 0), as float32."""
    bits = x.clamp(max=65504.0).half().view(torch.int16)
    return [(bits + step).clamp(min=0).view(torch.float16).float() for step in (0, -1, 1)]


def _guesses(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, offsets), each (guesses, B), for the runs v: (B, 32): as a Q4_1 run (the
    offset its minimum, 15 steps up to its maximum), a Q8_0 one (127 steps either side of
    zero) and a Q4_0 one (its largest magnitude is -8 steps); float16 scales throughout."""
    lo, hi = v.aminmax(dim=1)
    extreme = torch.where(hi.abs() >= lo.abs(), hi, lo)
    zero = torch.full_like(lo, -0.0)  # -0.0: scale * 0 + offset keeps the sign of scale * 0
    pairs = [(s, lo) for s in _half((hi - lo) / 15)]
    pairs += [(s, zero) for s in _half(extreme.abs() / 127)]
    pairs.append(((extreme / -8).half().float(), zero))
    return (torch.stack([s for s, _ in pairs]).contiguous(),
            torch.stack([o for _, o in pairs]).contiguous())


def encode(weight: torch.Tensor) -> CodedWeight | None:
    """A float32 CPU weight (out, in) as 4-bit codes, else 8-bit codes, else bfloat16, else
    None (also when disabled, or where the native kernels are not built)."""
    if (os.environ.get(DISABLE_ENV, "1") == "0" or weight.dtype != torch.float32
            or weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0):
        return None
    lib = native.load()
    if lib is None:
        return None
    return _codes(weight, lib) or _bfloat16(weight)


def _bfloat16(weight: torch.Tensor) -> CodedWeight | None:
    bits = weight.detach().contiguous().view(torch.int32)
    if (bits & 0xFFFF).any():
        return None
    return CodedWeight(codes=pack_panels((bits >> 16).to(torch.int16)), params=None)


def _codes(weight: torch.Tensor, lib) -> CodedWeight | None:
    out_features, in_features = weight.shape
    if in_features % RUN:
        return None
    v = weight.detach().contiguous().view(-1, RUN)  # (B, 32), B = out * in / 32
    scale_guesses, offset_guesses = _guesses(v)
    codes = torch.empty(v.shape, dtype=torch.int8)
    scales, offsets = torch.empty(v.shape[0]), torch.empty(v.shape[0])
    failed = lib.code_runs_f32(v.data_ptr(), v.shape[0], scale_guesses.data_ptr(),
                               offset_guesses.data_ptr(), scale_guesses.shape[0],
                               codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(),
                               torch.get_num_threads())
    if failed:
        return None
    coded = CodedWeight(codes=pack_panels(codes.view(out_features, in_features)),
                        params=_run_params(scales, offsets, out_features, in_features))
    return _nibbles(coded) or coded


def _nibbles(coded: CodedWeight) -> CodedWeight | None:
    """The 4-bit form of 8-bit codes, where every code is in 0 .. 15 and every param a float16
    value (bit for bit, the sign of a zero too)."""
    params16 = coded.params.half()
    exact = torch.equal(params16.float().view(torch.int32), coded.params.view(torch.int32))
    if not exact or coded.codes.min() < 0 or coded.codes.max() > 15:
        return None
    codes = coded.codes.view(torch.uint8)  # (P, in, 32)
    return CodedWeight(codes=(codes[..., :16] | (codes[..., 16:] << 4)).contiguous(),
                       params=params16.contiguous())


def _run_params(scales: torch.Tensor, offsets: torch.Tensor, out_features: int,
                in_features: int) -> torch.Tensor:
    """Scales and offsets (out * in / 32,) -> (ceil(out / 32), in / 32, 2, 32)."""
    both = torch.stack([scales, offsets]).view(2, out_features, in_features // RUN)
    num_panels = -(-out_features // PANEL)
    padded = both.new_zeros(2, num_panels * PANEL, in_features // RUN)
    padded[:, :out_features] = both
    # (2, P, 32, runs) -> (P, runs, 2, 32)
    return padded.view(2, num_panels, PANEL, -1).permute(1, 3, 0, 2).contiguous()


def rebuild(coded: CodedWeight, out_features: int) -> torch.Tensor:
    """The float32 weight (out, in) the coded form stands for (for tests and checks)."""
    num_panels, in_features, _ = coded.codes.shape
    if coded.params is None:
        bits = coded.codes.to(torch.int32).bitwise_left_shift(16)
        return bits.view(torch.float32).transpose(1, 2).reshape(-1, in_features)[:out_features]
    codes = coded.codes
    if coded.bits == 4:  # low halves: outputs 0-15 of a panel, high halves: 16-31
        codes = torch.cat([codes & 15, codes >> 4], dim=2)
    codes = codes.float().transpose(1, 2).reshape(num_panels * PANEL, in_features)
    params = coded.params.float().permute(2, 0, 3, 1).reshape(2, num_panels * PANEL, -1)
    scale, offset = (p.repeat_interleave(RUN, dim=1) for p in params)
    return (scale * codes + offset)[:out_features]
