"""Coded weights (kernels/coded_weights.py, csrc/linear_coded.c): a float32 weight dequantized
from GGUF's Q4_0, Q4_1 or Q8_0 blocks is proved to be 8-bit codes times a scale plus an offset
(Q4_1's then held two codes a byte), one with bfloat16 values is held as bfloat16, all rebuilt
bit for bit, and the coded kernel gives linear_f32's results bit for bit (and F.linear's within
float32 rounding); any other weight keeps the float32 path. Builds whose engine keeps to the
panels (4 lanes: cpu_linear.coded_max_rows() is 0) still run the coded kernel here."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pdserve.kernels import cpu_linear, native
from pdserve.kernels.coded_weights import DISABLE_ENV, encode, rebuild
from pdserve.kernels.cpu_linear import CODED_MAX_ROWS, PackedLinear
from pdserve.models.gguf_file import dequantize_ggml

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels not built")


@pytest.fixture(autouse=True)
def coded_on_every_build(monkeypatch):
    monkeypatch.setattr(cpu_linear, "coded_max_rows", lambda: CODED_MAX_ROWS)


def gguf_weight(shape, qtype, seed=0) -> torch.Tensor:
    """A random weight through gguf's quantizer and the loader's dequantization."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    raw = torch.from_numpy(quants.quantize(w, qtype).reshape(-1).view(np.uint8).copy())
    return dequantize_ggml(raw, qtype, shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_blocks_are_coded_and_rebuilt_bit_for_bit(qtype):
    w = gguf_weight((100, 192), qtype)
    coded = encode(w)
    assert coded is not None
    # Q4_1's codes are 0 .. 15 under float16 scales and offsets: two codes a byte. Q4_0's
    # run from -8 and Q8_0's from -127: a byte each, float32 params.
    nibbles = qtype == Q.Q4_1
    assert coded.bits == (4 if nibbles else 8)
    assert coded.codes.shape == (4, 192, 16 if nibbles else 32)
    assert coded.params.shape == (4, 6, 2, 32)
    assert coded.params.dtype == (torch.float16 if nibbles else torch.float32)
    assert torch.equal(bits(rebuild(coded, 100)), bits(w))
    assert not coded.codes[3, :, 4:16].any()  # outputs past 100: zero codes


def test_bfloat16_values_are_held_as_bfloat16():
    w = torch.randn(100, 200).bfloat16().float()  # 200 inputs: not runs of 32
    coded = encode(w)
    assert coded is not None and coded.params is None
    assert coded.codes.dtype == torch.int16 and coded.codes.shape == (4, 200, 32)
    assert torch.equal(bits(rebuild(coded, 100)), bits(w))
    w[5, 7] = torch.nextafter(w[5, 7], torch.tensor(1.0))  # no longer a bfloat16 value
    assert encode(w) is None


@pytest.mark.parametrize("case", ["random", "one value off", "nan", "width"])
def test_other_weights_are_not_coded(case):
    w = gguf_weight((64, 128), Q.Q4_1)
    if case == "random":
        w = torch.randn(64, 128)
    elif case == "one value off":
        w[7, 45] = torch.nextafter(w[7, 45], torch.tensor(1.0))
    elif case == "nan":
        w[3, :32] = float("nan")
    else:
        w = gguf_weight((64, 128), Q.Q4_1)[:, :100]
    assert encode(w) is None
    assert PackedLinear(w).codes is None


@pytest.mark.parametrize("form", [Q.Q4_0, Q.Q4_1, Q.Q8_0, "bfloat16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inputs", [96, 128, 320])
def test_coded_kernel_equals_the_float32_panels_bit_for_bit(form, bias, inputs):
    torch.manual_seed(0)
    # 100 outputs: a partial last panel; where rows share rebuilt weights (more rows than one
    # group), inputs go in chunks of 128: one partial chunk, one whole, or 128 + 128 + 64
    w = ((torch.randn(100, inputs) * 0.05).bfloat16().float() if form == "bfloat16"
         else gguf_weight((100, inputs), form, seed=1))
    b = torch.randn(100) if bias else None
    layer = PackedLinear(w, b)
    assert layer.codes is not None
    wide = torch.randn(40, 352)
    for rows in (1, 2, 7, 10, 11, 17, 29, CODED_MAX_ROWS):
        x = wide[:rows, :inputs]  # rows with a stride wider than the inputs
        coded = layer(x)
        codes, layer.codes = layer.codes, None  # the float32 panels
        plain = layer(x)
        layer.codes = codes
        assert torch.equal(bits(coded), bits(plain)), rows
        reference = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(coded.double(), reference, rtol=1e-5, atol=1e-5)



def test_coded_weights_can_be_turned_off(monkeypatch):
    w = gguf_weight((64, 128), Q.Q4_1)
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert encode(w) is None and PackedLinear(w).codes is None
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert PackedLinear(w).codes is not None
