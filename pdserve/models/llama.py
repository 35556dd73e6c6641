"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3) over the
paged KV cache.

Pre-norm transformer: RMSNorm -> grouped-query attention with rotary position embeddings ->
residual -> RMSNorm -> SwiGLU MLP -> residual; final RMSNorm and a (possibly tied) LM head.
References: Touvron et al. 2023 (LLaMA), Su et al. 2021 (RoPE), Shazeer 2020 (SwiGLU),
Ainslie et al. 2023 (GQA). Qwen2 adds biases to the q/k/v projections; Qwen3 drops them and
RMS-normalises every query and key head before the rotary embedding; Phi-3 checkpoints store
the q/k/v and gate/up projections already fused (in the layout used here). Gemma 2/3's layers,
norms and embedding scale are in gemma.py; its attention settings are read here from the arch.

All tokens of a step are flattened into one batch of T tokens; `AttentionMetadata` tells each
attention layer where they go in the cache and which context each one sees.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.attention import AttentionMetadata
from pdserve.kernels.cpu_fused import add_rms_norm, can_rotate_in_place, rms_norm, \
    rotate_in_place, silu_mul, torch_rotary
from pdserve.kernels.cpu_layers import NativeLayers
from pdserve.kernels.cpu_linear import PackedLinear, can_pack, pack_linears
from pdserve.kernels.dispatch import paged_attention
from pdserve.models.arch import ModelArch


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,), with Llama 3 style scaling when configured."""
    d = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = arch.rope_scaling_dict or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, scaled))
    elif kind != "default":
        raise ValueError(f"rope_scaling: type {kind!r} is not supported")
    return inv_freq.float()


class Rotary(nn.Module):
    """Rotary embedding in the half-split layout (`rotate_half`) of Hugging Face checkpoints."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        t = torch.arange(arch.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(arch))  # (max_pos, d/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, d/2) each: looked up once per step, shared by every layer."""
        return (self.cos.index_select(0, positions)[:, None, :],
                self.sin.index_select(0, positions)[:, None, :])

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, d) -> rotated, same dtype."""
        return torch_rotary(x, cos, sin)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        return [self.rotate(x, cos, sin) for x in xs]


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int = 0, norm: type[nn.Module] | None = None):
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.scale = (arch.query_pre_attn_scalar or self.head_dim) ** -0.5
        # Gemma: soft-capped scores (2); a sliding window on some layers (None elsewhere).
        self.softcap = arch.attn_logit_softcapping
        self.window = arch.layer_window(layer)
        if arch.qk_norm:
            norm = norm or RMSNorm  # Gemma 3: gemma.GemmaRMSNorm
            self.q_norm = norm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = norm(self.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden), or (R, hidden) for rows (R,) alone; every token's
        keys and values reach the cache either way."""
        T = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (h + 2 kvh) d)
        # q and k are adjacent columns: rotate them as one (T, h + kvh, d) tensor.
        qk = qkv[:, :self.q_size + self.kv_size].view(T, h + kvh, d)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        if can_rotate_in_place(qk, *cos_sin):
            rotate_in_place(qk, *cos_sin)  # qkv (or the normed copy) is this call's own
        else:
            qk = Rotary.rotate(qk, *cos_sin)
        q, k = qk[:, :h], qk[:, h:]  # (T, h, d), (T, kvh, d)
        v = qkv[:, self.q_size + self.kv_size:].view(T, kvh, d)
        if self.softcap is None and self.window is None:
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        else:
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                  softcap=self.softcap, sliding_window=self.window)
        out = out.reshape(T, self.q_size)
        return self.o_proj(out if rows is None else out[rows])


class MLP(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x, cos_sin, kv_cache, meta, rows=None):
        """x: (T, hidden), this layer's to update in place (the embedding's or the previous
        layer's output). With rows (R,), the output projection and MLP run for those rows
        alone: (R, hidden)."""
        attn = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta, rows)
        x = x if rows is None else x[rows]
        norm = self.post_attention_layernorm
        x, normed = add_rms_norm(x, attn, norm.weight, norm.eps)  # residual add + norm, fused
        return x + self.mlp(normed)


def _check_output_rows(rows: torch.Tensor, T: int) -> None:
    """rows: (R,) strictly increasing rows of a T-token step, or ValueError."""
    if rows.dim() != 1 or rows.numel() and bool(
            (rows[0] < 0) | (rows[-1] >= T) | (rows.diff() <= 0).any()):
        raise ValueError("output rows are not strictly increasing rows of the step")


class LlamaForCausalLM(nn.Module):
    """The decoder; `forward` returns final hidden states, `compute_logits` the vocab scores."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.final_softcap = arch.final_logit_softcapping
        if arch.is_gemma:  # Gemma 2/3: models/gemma.py
            from pdserve.models import gemma

            self.layers = nn.ModuleList(gemma.GemmaDecoderLayer(arch, i)
                                        for i in range(arch.num_hidden_layers))
            self.norm = gemma.GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        else:
            self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = Rotary(arch)
        # Gemma 3: sliding-window layers have their own rotary embedding.
        self.local_rotary = None
        if arch.local_rope_theta is not None:
            self.local_rotary = Rotary(dataclasses.replace(
                arch, rope_theta=arch.local_rope_theta, rope_scaling=arch.local_rope_scaling))
        self.layer_is_local = [self.local_rotary is not None and arch.layer_window(i) is not None
                               for i in range(arch.num_hidden_layers)]
        self.lm_head = (None if arch.tie_word_embeddings
                        else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False))
        self.native_layers: NativeLayers | None = None  # set by pack_for_cpu where it applies

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: (T,); kv_cache: (layers, 2, blocks, block_size, kvh, d).
        Returns the final hidden states (T, hidden), or only those of output_rows (R,),
        strictly increasing: (R, hidden). Every token's keys and values reach the cache
        either way; the last layer's output projection and MLP (the native loop: its
        attention too) then run for the output rows alone."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        if self.arch.is_gemma:
            from pdserve.models.gemma import embedding_scale

            x = x * embedding_scale(self.arch, x.dtype).to(x.device)
        cos_sin = self.rotary.cos_sin(positions)
        local = None if self.local_rotary is None else self.local_rotary.cos_sin(positions)
        if self.native_layers is not None and self.native_layers.serves(x, cos_sin[0], kv_cache):
            self.native_layers(x, *cos_sin, kv_cache, meta, output_rows)  # one native call
            return self.norm(x if output_rows is None else x[:output_rows.numel()])
        if output_rows is not None:
            _check_output_rows(output_rows, x.shape[0])
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):  # the last layer for the output rows alone
            x = layer(x, local if self.layer_is_local[i] else cos_sin, kv_cache[i], meta,
                      output_rows if i == last else None)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) in float32."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def pack_for_cpu(self) -> None:
        """Once the weights are loaded: every projection also in a packed layout when it
        applies (float32 on CPU), the tied LM head too (kernels/cpu_linear.py)."""
        pack_linears(self)
        if self.lm_head is None and can_pack(self.embed_tokens.weight):
            self.lm_head = PackedLinear(self.embed_tokens.weight)
        self.native_layers = NativeLayers.build(self)

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up projections (Phi-3
        checkpoints have them fused already: q rows, then k, then v; gate, then up)."""
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
        own = dict(self.named_parameters())
        missing = set(own)
        for i in range(self.arch.num_hidden_layers):
            p = f"layers.{i}."
            att = p + "self_attn."
            if att + "qkv_proj.weight" not in sd:
                sd[att + "qkv_proj.weight"] = torch.cat(
                    [sd.pop(att + f"{n}_proj.weight") for n in "qkv"])
            if self.arch.attention_bias and att + "qkv_proj.bias" not in sd:
                sd[att + "qkv_proj.bias"] = torch.cat(
                    [sd.pop(att + f"{n}_proj.bias") for n in "qkv"])
            if p + "mlp.gate_up_proj.weight" not in sd:
                sd[p + "mlp.gate_up_proj.weight"] = torch.cat(
                    [sd.pop(p + "mlp.gate_proj.weight"), sd.pop(p + "mlp.up_proj.weight")])
        for name, tensor in sd.items():
            if name not in own:
                continue  # e.g. rotary inv_freq buffers, or lm_head when tied
            if own[name].shape != tensor.shape:
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)} does not match "
                                 f"the model's {tuple(own[name].shape)}")
            own[name].copy_(tensor)
            missing.discard(name)
        if missing:
            raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:5]}")
