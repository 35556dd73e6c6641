"""ModelArch: the immutable shape description of a Llama-family decoder."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                           "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                           "Gemma3ForCausalLM"}
GEMMA_ARCHITECTURES = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}
# Known architectures that need attention features the paged kernels lack: what is missing.
_NEEDS_KERNEL_FEATURES: dict[str, str] = {}

# model_type -> architecture, for configs that carry no `architectures` list (e.g. GGUF).
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def check_architecture(architecture: str) -> None:
    """Raise ValueError unless `architecture` is one pdserve can run."""
    if architecture in _NEEDS_KERNEL_FEATURES:
        raise ValueError(f"architecture: {architecture} needs "
                         f"{_NEEDS_KERNEL_FEATURES[architecture]}, not supported yet")
    if architecture not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ValueError(
            f"model: architecture {architecture!r} is not supported (supported: {supported})"
        )


def _freeze(value: Any) -> Any:
    """Turn lists (e.g. longrope factors) into tuples so the value is hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _rope(cfg: Any) -> tuple[float, tuple[tuple[str, object], ...] | None]:
    """Return (rope_theta, hashable rope scaling) for transformers v4 and v5 configs."""
    params = getattr(cfg, "rope_parameters", None)  # transformers >= 5
    if not isinstance(params, dict):
        params = dict(getattr(cfg, "rope_scaling", None) or {})  # transformers 4.x
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    theta = float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
    # partial_rotary_factor (Phi-3's config carries 1.0) is checked in _check_unsupported.
    scaling = {k: v for k, v in params.items()
               if k not in ("rope_theta", "partial_rotary_factor")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default") and set(scaling) <= {"rope_type", "type"}:
        return theta, None
    return theta, tuple(sorted((k, _freeze(v)) for k, v in scaling.items()))


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _dtype_name(value: Any) -> str:
    if value is None:
        return "float32"
    return str(value).removeprefix("torch.")


@dataclass(frozen=True)
class ModelArch:
    """Hyper-parameters of a Llama/Qwen2/Mistral decoder, independent of transformers."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, object], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before the rotary
    # Gemma 2 and 3 (None/"silu" elsewhere): attention scale query_pre_attn_scalar ** -0.5,
    # tanh soft-capping of attention scores and of the final logits (Gemma 2), and a sliding
    # window on the layers whose layer_types entry is "sliding_attention".
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # Gemma 3: the sliding-window layers' own rotary embedding (rope_theta/rope_scaling are
    # the full-attention layers'); None: every layer uses rope_theta/rope_scaling.
    local_rope_theta: float | None = None
    local_rope_scaling: tuple[tuple[str, object], ...] | None = None

    @property
    def is_gemma(self) -> bool:
        """Gemma layout: scaled embeddings, (1 + weight) RMSNorms, four norms per layer."""
        return self.architecture in GEMMA_ARCHITECTURES

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (a query at position p sees keys at
        positions p - window + 1 .. p), or None for full causal attention."""
        if self.sliding_window is None or self.layer_types is None:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def rope_scaling_dict(self) -> dict[str, object] | None:
        """The rope scaling as a plain dict (HF layout, without rope_theta), or None."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> ModelArch:
        """Rebuild from `dataclasses.asdict` output that went through JSON (lists become
        the tuples they were)."""
        return cls(**{name: _freeze(value) for name, value in fields.items()})

    @classmethod
    def from_hf_config(cls, cfg: Any, generation_config: Any = None) -> "ModelArch":
        """Build from a transformers PretrainedConfig (and optional GenerationConfig)."""
        archs = getattr(cfg, "architectures", None) or []
        if archs:
            architecture = archs[0]
        else:
            model_type = getattr(cfg, "model_type", "")
            architecture = _MODEL_TYPE_TO_ARCH.get(model_type, f"<model_type {model_type!r}>")
        check_architecture(architecture)
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("model: mlp_bias=True is not supported")

        heads = int(cfg.num_attention_heads)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if architecture == "Qwen2ForCausalLM":
            attention_bias = True  # Qwen2 always has q/k/v biases
        else:
            attention_bias = bool(getattr(cfg, "attention_bias", False))
        if architecture == "Gemma3ForCausalLM":
            rope_theta, rope_scaling = _gemma3_rope(cfg, "full_attention")
        else:
            rope_theta, rope_scaling = _rope(cfg)
        _check_unsupported(cfg, architecture, rope_scaling)
        max_positions = int(cfg.max_position_embeddings)
        window = getattr(cfg, "sliding_window", None)
        if architecture == "Phi3ForCausalLM" and window:
            # Phi-3 attends only the last `sliding_window` tokens: serve contexts that fit in
            # the window, where that is the same as full causal attention.
            max_positions = min(max_positions, int(window))

        eos: list[int] = []
        if generation_config is not None:
            eos += _as_ids(getattr(generation_config, "eos_token_id", None))
        eos += _as_ids(getattr(cfg, "eos_token_id", None))
        bos = getattr(cfg, "bos_token_id", None)
        dtype = cfg.dtype if hasattr(cfg, "dtype") else getattr(cfg, "torch_dtype", None)

        gemma = _gemma_fields(cfg, architecture) if architecture in GEMMA_ARCHITECTURES else {}
        return cls(
            architecture=architecture,
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_hidden_layers=int(cfg.num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            torch_dtype=_dtype_name(dtype),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            **gemma,
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _gemma3_rope(cfg: Any, layer_type: str) -> tuple[float, Any]:
    """Gemma 3's (rope_theta, rope scaling) of one layer type: transformers >= 5 keeps one
    rope_parameters dict per layer type; 4.x has rope_theta/rope_scaling for full attention
    and rope_local_base_freq (no scaling) for sliding windows."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        return _rope(SimpleNamespace(rope_parameters=dict(params[layer_type] or {})))
    if layer_type == "full_attention":
        return _rope(cfg)
    return float(getattr(cfg, "rope_local_base_freq", 10000.0)), None


def _gemma_fields(cfg: Any, architecture: str) -> dict[str, Any]:
    """The Gemma 2/3 specific ModelArch fields."""
    layers = int(cfg.num_hidden_layers)
    # Configs without layer_types: every `pattern`-th layer has full attention, others slide.
    pattern = 2 if architecture == "Gemma2ForCausalLM" else int(
        getattr(cfg, "sliding_window_pattern", None)
        or getattr(cfg, "_sliding_window_pattern", None) or 6)
    types = getattr(cfg, "layer_types", None) or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    window = getattr(cfg, "sliding_window", None)
    local_rope = {}
    if architecture == "Gemma3ForCausalLM":
        theta, scaling = _gemma3_rope(cfg, "sliding_attention")
        local_rope = dict(local_rope_theta=theta, local_rope_scaling=scaling)
    return dict(
        **local_rope,
        hidden_act=str(getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"),
        query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
        attn_logit_softcapping=_optional_float(getattr(cfg, "attn_logit_softcapping", None)),
        final_logit_softcapping=_optional_float(getattr(cfg, "final_logit_softcapping", None)),
        sliding_window=None if window is None else int(window),
        layer_types=tuple(str(t) for t in types),
    )


def _check_unsupported(cfg: Any, architecture: str, rope_scaling: Any) -> None:
    """Raise ValueError for config options the decoder does not implement."""
    if architecture in GEMMA_ARCHITECTURES:
        act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"model: hidden_activation {act!r} is not supported for "
                             f"{architecture} (only gelu_pytorch_tanh)")
        types = getattr(cfg, "layer_types", None) or []
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(f"model: layer_types {unknown} are not supported "
                             "(only sliding_attention and full_attention)")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(f"model: use_bidirectional_attention=True ({architecture} as an "
                             "encoder) is not supported")
        if len(types) not in (0, int(cfg.num_hidden_layers)):
            raise ValueError(f"model: layer_types has {len(types)} entries for "
                             f"{cfg.num_hidden_layers} layers")
    else:
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"model: hidden_act {act!r} is not supported (only silu)")
    params = getattr(cfg, "rope_parameters", None)
    factor = (params.get("partial_rotary_factor") if isinstance(params, dict) else None) \
        or getattr(cfg, "partial_rotary_factor", None) or 1.0
    if float(factor) != 1.0:
        raise ValueError(f"model: partial_rotary_factor={factor} (rotary embedding on part of "
                         "each head) is not supported")
    kind = dict(rope_scaling or {}).get("rope_type", dict(rope_scaling or {}).get("type"))
    if architecture == "Phi3ForCausalLM" and rope_scaling is not None:
        raise ValueError(f"rope_scaling: {architecture} with rope_scaling type {kind!r} "
                         "(longrope/su) is not supported; only rope_scaling None is")
    if kind in ("longrope", "su"):
        raise ValueError(f"rope_scaling: type {kind!r} is not supported")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and getattr(
            cfg, "use_sliding_window", False):
        layers = int(cfg.num_hidden_layers)
        types = getattr(cfg, "layer_types", None) or [
            "sliding_attention" if i >= getattr(cfg, "max_window_layers", layers)
            else "full_attention" for i in range(layers)]
        if "sliding_attention" in types:
            raise ValueError(f"model: {architecture} with use_sliding_window=True "
                             "(sliding-window attention layers) is not supported")
