"""oneDNN-packed linear layers against F.linear, alone and inside the model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu_linear import PackedLinear, can_pack, pack_linears
from pdserve.models.arch import ModelArch
from pdserve.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    with torch.inference_mode():
        got = PackedLinear(weight, b)(x)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_pack_linears_replaces_float32_cpu_layers_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4), nn.ReLU()),
                          nn.Linear(4, 4).to(torch.float64))
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert isinstance(model[2], nn.Linear) and not can_pack(model[2].weight)
    assert not any(p.dtype == torch.float32 for p in model.parameters())
    assert model[0].weight.data_ptr() != 0 and model[0].packed_weight.is_mkldnn


def test_packed_model_matches_plain_model():
    arch = ModelArch(architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=True,
                     attention_bias=False, bos_token_id=None, eos_token_ids=(0,),
                     torch_dtype="float32")
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
