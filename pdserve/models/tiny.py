"""Write a tiny, random Llama/Qwen2/Qwen3/Phi-3/Gemma 2/Gemma 3 checkpoint (real SmolLM2
tokenizer) for tests.

Usage: python -m pdserve.models.tiny PATH
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from pdserve.models.arch import ModelArch
from pdserve.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_model

# Bump when the generated weights change, so cached directories are rewritten.
_FORMAT_VERSION = 1
_MARKER = "pdserve_tiny.json"
# Weight std: large enough that attention is far from uniform and that greedy argmax
# margins are clear (logit std ~1.6 with hidden 64), small enough to stay well conditioned.
_INIT_STD = 0.2


def _build_config(architecture: str, tok: Any, kw: dict[str, Any]) -> Any:
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    common = dict(
        vocab_size=len(tok),
        hidden_size=kw["hidden_size"],
        intermediate_size=kw["intermediate_size"],
        num_hidden_layers=kw["num_hidden_layers"],
        num_attention_heads=kw["num_attention_heads"],
        num_key_value_heads=kw["num_key_value_heads"],
        max_position_embeddings=kw["max_position_embeddings"],
        tie_word_embeddings=kw["tie_word_embeddings"],
        initializer_range=_INIT_STD,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if architecture == "LlamaForCausalLM":
        cfg = LlamaConfig(attention_bias=kw["attention_bias"], **common)
    elif architecture == "Qwen2ForCausalLM":
        cfg = Qwen2Config(use_sliding_window=False, **common)
    elif architecture == "Qwen3ForCausalLM":
        head_dim = kw["head_dim"] or kw["hidden_size"] // kw["num_attention_heads"]
        cfg = Qwen3Config(use_sliding_window=False, head_dim=head_dim,
                          attention_bias=kw["attention_bias"], **common)
    elif architecture == "Phi3ForCausalLM":
        cfg = Phi3Config(rope_scaling=None, sliding_window=None, **common)
    elif architecture == "Gemma2ForCausalLM":
        head_dim = kw["head_dim"] or kw["hidden_size"] // kw["num_attention_heads"]
        # Small soft-caps and a query_pre_attn_scalar other than head_dim, so that each of
        # them changes the logits.
        cfg = Gemma2Config(head_dim=head_dim, query_pre_attn_scalar=head_dim + 8,
                           sliding_window=kw["sliding_window"] or 8, attn_logit_softcapping=2.0,
                           final_logit_softcapping=5.0, hidden_activation="gelu_pytorch_tanh",
                           **common)
    elif architecture == "Gemma3ForCausalLM":
        head_dim = kw["head_dim"] or kw["hidden_size"] // kw["num_attention_heads"]
        layers = kw["num_hidden_layers"]
        # Full attention every third layer (the last one), a linearly scaled rotary embedding
        # there and a different base on the sliding layers, so that each changes the logits.
        cfg = Gemma3TextConfig(
            head_dim=head_dim, query_pre_attn_scalar=head_dim + 8,
            sliding_window=kw["sliding_window"] or 8, hidden_activation="gelu_pytorch_tanh",
            layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                         for i in range(layers)],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
            **common)
    else:
        raise ValueError(f"model: tiny architecture {architecture!r} is not supported")
    cfg.architectures = [architecture]
    return cfg


def tiny_arch(**overrides: Any) -> ModelArch:
    """A small float32 Llama architecture (2 layers, hidden 64, 4 heads of 16, 2 KV heads, 300
    tokens) for building random models in memory; `overrides` replace any field."""
    fields: dict[str, Any] = dict(
        architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_ids=(0,),
        torch_dtype="float32")
    return ModelArch(**(fields | overrides))


def write_tiny_llama(
    path: str | Path,
    *,
    seed: int = 0,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    architecture: str = "LlamaForCausalLM",
    head_dim: int | None = None,
    sliding_window: int | None = None,
) -> Path:
    """Write a random float32 HF checkpoint with the SmolLM2 tokenizer to `path`; return it.

    Deterministic for a given seed and shape; a directory already written with the same
    arguments is reused as is.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    kw = dict(
        seed=seed, num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, attention_bias=attention_bias,
        architecture=architecture, version=_FORMAT_VERSION,
    )
    if head_dim is not None:  # Qwen3: a head size other than hidden / heads
        kw["head_dim"] = head_dim
    if sliding_window is not None:  # Gemma 2/3 (default 8)
        kw["sliding_window"] = sliding_window
    marker = path / _MARKER
    if marker.is_file() and json.loads(marker.read_text()) == kw and (path / "model.safetensors").is_file():
        return path

    tok = load_tokenizer(resolve_model(DEFAULT_MODEL))
    cfg = _build_config(architecture, tok, {"head_dim": None, "sliding_window": None, **kw})
    gemma = architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # non-trivial norm weights catch loading bugs
                # (Gemma's norms scale by 1 + weight: weights around 0 there)
                p.copy_(float(not gemma) + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):  # HF zero-inits biases; make them matter
                p.copy_(_INIT_STD * torch.randn_like(p))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    marker.write_text(json.dumps(kw, indent=1))
    return path


def main(argv: list[str] | None = None) -> None:
    """CLI: write a tiny model directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--architecture", default="LlamaForCausalLM")
    parser.add_argument("--tie-word-embeddings", action="store_true")
    args = parser.parse_args(argv)
    out = write_tiny_llama(
        args.path, seed=args.seed, num_hidden_layers=args.layers,
        architecture=args.architecture, tie_word_embeddings=args.tie_word_embeddings,
        attention_bias=args.architecture == "Qwen2ForCausalLM",
    )
    print(out)


if __name__ == "__main__":
    main()
