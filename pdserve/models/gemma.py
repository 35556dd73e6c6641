"""Gemma 2 and Gemma 3 (text) decoder pieces, composed by `LlamaForCausalLM` when
`arch.is_gemma`.

Differences from the Llama layout (Gemma Team 2024, "Gemma 2"): token embeddings are scaled
by sqrt(hidden_size); RMSNorm multiplies by (1 + weight), with weights stored around zero;
each layer normalises the attention output and the MLP output before their residual adds
(four norms per layer); the MLP is gated with tanh-approximated GELU; attention scores are
scaled by query_pre_attn_scalar ** -0.5 and soft-capped (cap * tanh(scores / cap)); layers
alternate between sliding-window and full causal attention; the final logits are
soft-capped too. Gemma 3 (text) drops both soft-caps, RMS-normalises each query and key head
((1 + weight) norms, as Qwen3 does with plain ones), slides on five layers of six, and gives
the sliding layers their own rotary base (`arch.local_rope_theta`). Attention itself is
`llama.Attention`, which reads the per-layer scale, soft-cap and window from the arch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.attention import AttentionMetadata
from pdserve.models.arch import ModelArch
from pdserve.models.llama import Attention, RMSNorm


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight), computed in float32 and cast back at the end."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused in one projection."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int):
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.self_attn = Attention(arch, layer, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.mlp = GemmaMLP(arch)
        self.post_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden), or (R, hidden) for rows (R,) alone."""
        attn = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta, rows)
        x = (x if rows is None else x[rows]) + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


def embedding_scale(arch: ModelArch, dtype: torch.dtype) -> torch.Tensor:
    """sqrt(hidden_size), rounded to float32 and then to the model dtype."""
    return torch.tensor(arch.hidden_size ** 0.5, dtype=torch.float32).to(dtype)

