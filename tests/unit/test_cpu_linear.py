"""Packed linear layers (the native kernel's panels and oneDNN's layout): alone against a
float64 reference, inside the model against the plain nn.Linear model."""

import pytest
import torch
from torch import nn

from pdserve.kernels import native
from pdserve.kernels.cpu_linear import PackedLinear, can_pack, pack_linears, pack_panels
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.tiny import tiny_arch

LAYOUTS = [pytest.param("panels", marks=pytest.mark.skipif(native.load() is None,
                                                           reason="native kernels not built")),
           pytest.param("onednn", marks=pytest.mark.skipif(
               not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"))]


def reference(x, weight, bias):
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 8, 14, 17, 29, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_reference(layout, rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    with torch.inference_mode():
        got = PackedLinear(weight, b, layout=layout)(x)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(native.load() is None, reason="native kernels not built")
@pytest.mark.parametrize("out_features,in_features,rows", [
    (33, 7, 5),      # a last panel of one output; k shorter than a vector
    (70, 2048, 150),  # rows in several cache blocks (2048 inputs: 56 rows a block)
    (960, 576, 64),   # SmolLM2's fused qkv at a decode step's size
    (5, 3, 0),        # no rows at all
])
@pytest.mark.parametrize("bias", [False, True])
def test_panels_shapes_and_padding(out_features, in_features, rows, bias):
    g = torch.Generator().manual_seed(out_features + rows)
    weight = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features + 3, generator=g)[:, 1:in_features + 1]  # strided rows
    layer = PackedLinear(weight, b, layout="panels")
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), reference(x, weight, b), rtol=1e-4, atol=1e-4)
    panels = layer.packed_weight  # (ceil(out / 32), in, 32), zeros past `out`
    assert panels.shape == (-(-out_features // 32), in_features, 32)
    unpacked = panels.transpose(1, 2).reshape(-1, in_features)
    assert torch.equal(unpacked[:out_features], weight) and not unpacked[out_features:].any()


@pytest.mark.skipif(native.load() is None, reason="native kernels not built")
def test_panels_row_results_do_not_depend_on_the_batch():
    """A row's outputs are bit-identical alone and among any other rows (one fma chain)."""
    g = torch.Generator().manual_seed(7)
    weight, x = torch.randn(200, 576, generator=g), torch.randn(45, 576, generator=g)
    layer = PackedLinear(weight, layout="panels")
    with torch.inference_mode():
        batch = layer(x)
        for i in (0, 13, 14, 44):
            assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])
        assert torch.equal(layer(x[10:30]), batch[10:30])


@pytest.mark.skipif(native.load() is None, reason="native kernels not built")
def test_panels_refuse_an_input_of_the_wrong_width():
    layer = PackedLinear(torch.randn(32, 16), layout="panels")
    with pytest.raises(ValueError, match="17 features"):
        layer(torch.randn(3, 17))


def test_pack_panels_layout():
    weight = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    panels = pack_panels(weight)
    assert panels.shape == (2, 3, 32)
    assert torch.equal(panels[1, 2, 7], weight[39, 2]) and torch.equal(panels[0, 1], weight[:32, 1])
    assert not panels[1, :, 8:].any()


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="layout"):
        PackedLinear(torch.randn(4, 4), layout="blocked")


@pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="no packed layout on this machine")
def test_pack_linears_replaces_float32_cpu_layers_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4), nn.ReLU()),
                          nn.Linear(4, 4).to(torch.float64))
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert isinstance(model[2], nn.Linear) and not can_pack(model[2].weight)
    assert not any(p.dtype == torch.float32 for p in model.parameters())
    assert model[0].weight.data_ptr() != 0 and model[0].packed_weight.numel() > 0


@pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="no packed layout on this machine")
def test_packed_model_matches_plain_model():
    arch = tiny_arch()
    torch.manual_seed(0)
    plain = LlamaForCausalLM(arch).eval()
    packed = LlamaForCausalLM(arch).eval()
    packed.load_state_dict(plain.state_dict())
    packed.pack_for_cpu()
    assert isinstance(packed.lm_head, PackedLinear)
    assert isinstance(packed.layers[0].self_attn.qkv_proj, PackedLinear)
    hidden = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden),
                                   rtol=1e-5, atol=1e-5)
        x = torch.randn(5, 64)
        for a, b in zip(packed.layers, plain.layers):
            torch.testing.assert_close(a.mlp(x), b.mlp(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(native.load() is None, reason="native kernels not built")
@pytest.mark.parametrize("n,k,rows", [
    (32, 7, 1),        # one pair of panels
    (96, 40, 17),      # three pairs, row groups of uneven size
    (64, 2048, 150),   # rows in several cache blocks
    (1536, 576, 64),   # SmolLM2's MLP at a step's size
])
def test_silu_mul_panels_match_the_two_kernels_bit_for_bit(n, k, rows):
    lib = native.load()
    g = torch.Generator().manual_seed(n + rows)
    weight = torch.randn(2 * n, k, generator=g) / k ** 0.5  # gate rows, then up rows
    x = torch.randn(rows, k + 2, generator=g)[:, 1:k + 1]  # strided rows
    panels = pack_panels(weight)
    gate_up, two_kernels, fused = (torch.empty(rows, 2 * n), torch.empty(rows, n),
                                   torch.full((rows, n), float("nan")))
    lib.linear_f32(x.data_ptr(), x.stride(0), rows, panels.data_ptr(), 2 * n, k, None,
                   gate_up.data_ptr(), 2 * n, 2)
    lib.silu_mul_f32(gate_up.data_ptr(), 2 * n, two_kernels.data_ptr(), n, rows, n, 2)
    assert lib.linear_silu_mul_f32(x.data_ptr(), x.stride(0), rows, panels.data_ptr(), n, k,
                                   fused.data_ptr(), n, 2) == 0
    assert torch.equal(fused, two_kernels)
    ref = x.double() @ weight.double().T
    want = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
    torch.testing.assert_close(fused.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(native.load() is None, reason="native kernels not built")
def test_silu_mul_panels_refuse_a_width_that_is_not_whole_panels():
    panels = pack_panels(torch.randn(2 * 40, 8))
    x, out = torch.randn(3, 8), torch.zeros(3, 40)
    assert native.load().linear_silu_mul_f32(x.data_ptr(), 8, 3, panels.data_ptr(), 40, 8,
                                             out.data_ptr(), 40, 2) == -1
    assert not out.any()  # nothing written
