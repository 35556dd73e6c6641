"""The fused native elementwise layers (kernels/csrc/elementwise.c) against the torch
expressions they replace, written out here."""

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_fused, native

pytestmark = pytest.mark.skipif(native.load() is None,
                                reason="no C compiler: the native kernels are not built")

SHAPES = [(1, 576), (7, 64), (300, 1000), (130, 17)]  # the last two: parallel rows, tails


def norm_ref(x, w, eps):
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)


@pytest.mark.parametrize("rows,n", SHAPES)
def test_rms_norm(rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    wide = torch.randn(rows, n + 5, generator=gen) * 3  # rows with a stride
    x, w = wide[:, 2:n + 2], torch.randn(n, generator=gen)
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-5), norm_ref(x, w, 1e-5),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,n", SHAPES)
def test_add_rms_norm_updates_x_in_place(rows, n):
    gen = torch.Generator().manual_seed(n)
    x, delta = torch.randn(rows, n, generator=gen), torch.randn(rows, n, generator=gen)
    w = torch.randn(n, generator=gen)
    want_sum = x + delta
    summed, normed = cpu_fused.add_rms_norm(x, delta, w, 1e-6)
    assert summed.data_ptr() == x.data_ptr()
    torch.testing.assert_close(summed, want_sum)
    torch.testing.assert_close(normed, norm_ref(want_sum, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,n", SHAPES)
def test_silu_mul(rows, n):
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * n, generator=gen) * 8  # exp far into both tails
    gate_up[0, :4] = torch.tensor([-200.0, -88.5, 88.5, 200.0])
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = (F.silu(gate) * up).float()
    torch.testing.assert_close(cpu_fused.silu_mul(gate_up), want, atol=1e-5, rtol=2e-6)


@pytest.mark.parametrize("heads,d", [(12, 64), (3, 128), (2, 40)])
def test_rotary_in_place(heads, d):
    gen = torch.Generator().manual_seed(d)
    T = 9
    proj = torch.randn(T, (heads + 2) * d, generator=gen)  # q, k heads then more columns
    x = proj[:, :heads * d].view(T, heads, d)
    angles = torch.rand(T, 1, d // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.double().chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).float()
    rest = proj[:, heads * d:].clone()
    assert cpu_fused.can_rotate_in_place(x, cos, sin)
    cpu_fused.rotate_in_place(x, cos, sin)
    torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(proj[:, heads * d:], rest)  # columns past the heads untouched


def test_other_dtypes_take_the_torch_path():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, dtype=torch.float64, generator=gen)
    w = torch.randn(32, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-6), norm_ref(x, w, 1e-6))
    gate_up = torch.randn(4, 64, dtype=torch.float64, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_fused.silu_mul(gate_up), F.silu(gate) * up)
    assert not cpu_fused.can_rotate_in_place(torch.randn(2, 3, 8, dtype=torch.float64),
                                             torch.ones(2, 1, 4, dtype=torch.float64),
                                             torch.ones(2, 1, 4, dtype=torch.float64))
