"""EngineArgs: the user's options (keyword arguments or CLI flags), turned into a frozen
EngineConfig exactly once."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from pdserve.engine import vllm_args
from pdserve.engine.kv_budget import CPU_DEFAULT_KV_BYTES
from pdserve.engine.ngram_drafts import SpeculativeConfig
from pdserve.models.loader import (DEFAULT_MODEL, TOKENIZER_MODES, HfOverrides, ResolvedModel,
                                   load_arch, resolve_model, resolve_tokenizer)

if TYPE_CHECKING:  # pdserve.config imports torch: loaded when a config is built, not for --help
    from pdserve.config import EngineConfig, TokenizerConfig


@dataclass
class EngineArgs:
    """Options for one engine, with vLLM's names and meanings where vLLM has them.

    The vLLM arguments after `device` are accepted for compatibility: those that cannot apply
    here are ignored with one log line (`vllm_args._IGNORED`), unsupported values raise
    ValueError naming the argument. README.md lists what each one does.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    gpu_memory_utilization: float = 0.92
    enable_prefix_caching: bool = True
    kv_cache_prefault: bool = False
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    kv_lease_s: float = 30.0
    kv_failure_policy: str = "recompute"
    max_prefill_tokens_with_decodes: int | None = None
    prefill_tokens_per_decode: int | None = None
    device: str = "auto"
    # vLLM's arguments
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    chat_template: str | None = None
    max_logprobs: int = 20
    served_model_name: str | list[str] | None = None
    hf_overrides: HfOverrides | None = None
    quantization: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    trust_remote_code: bool = False
    revision: str | None = None  # of a Hugging Face repo id in the local cache
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    download_dir: str | None = None
    enforce_eager: bool = False
    max_seq_len_to_capture: int | None = None
    compilation_config: int | dict | None = None
    disable_custom_all_reduce: bool = False
    swap_space: float | None = None
    cpu_offload_gb: float = 0
    disable_log_stats: bool = False
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    speculative_config: dict | None = None  # or its JSON text

    def create_tokenizer_config(self, resolved: ResolvedModel | None = None) -> TokenizerConfig:
        """The tokenizer to load: `tokenizer` if given, else the model's (`resolved`)."""
        from pdserve.config import TokenizerConfig

        if self.tokenizer:
            source = resolve_tokenizer(self.tokenizer)
        else:
            source = resolved or resolve_model(self.model, self.revision)
        return TokenizerConfig(source, self.tokenizer_mode,
                               vllm_args.load_chat_template(self.chat_template))

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model and check every option: the engine's frozen configuration."""
        from pdserve.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig,
                                    SchedulerConfig)
        from pdserve.engine.generation_defaults import max_tokens_cap, sampling_defaults

        resolved = resolve_model(self.model, self.revision)
        vllm_args.check_args(self, resolved)
        # checked before the model's config is read: a bad value fails without that wait
        cache = CacheConfig(self.block_size, self.kv_cache_memory_bytes,
                            self.gpu_memory_utilization, self.enable_prefix_caching,
                            self.kv_cache_memory_fraction, self.kv_cache_prefault)
        arch = load_arch(resolved, self.hf_overrides)
        device = DeviceConfig.detect() if self.device == "auto" else DeviceConfig(self.device)
        max_len = self.max_model_len or arch.max_position_embeddings
        if not 1 < max_len <= arch.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {arch.max_position_embeddings}], "
                             f"got {max_len}")
        defaults = sampling_defaults(resolved, self.generation_config,
                                     self.override_generation_config)
        model = ModelConfig(
            model=self.model, resolved=resolved, arch=arch,
            dtype=ModelConfig.resolve_dtype(self.dtype, arch, device.device),
            max_model_len=max_len, seed=self.seed,
            tokenizer=self.create_tokenizer_config(resolved), max_logprobs=self.max_logprobs,
            served_model_name=vllm_args.served_names(self.served_model_name),
            sampling_defaults=defaults,
            max_tokens_cap=max_tokens_cap(defaults, self.generation_config,
                                          self.override_generation_config))
        prefill_cap, per_decode = (self.max_prefill_tokens_with_decodes,
                                   self.prefill_tokens_per_decode)
        if device.device == "cpu":
            if prefill_cap is None:
                prefill_cap = CPU_PREFILL_TOKENS_WITH_DECODES
            if per_decode is None:
                per_decode = CPU_PREFILL_TOKENS_PER_DECODE
        scheduler = SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                                    self.scheduling_policy, self.enable_chunked_prefill,
                                    self.kv_lease_s, self.kv_failure_policy, prefill_cap,
                                    per_decode,
                                    SpeculativeConfig.from_vllm(self.speculative_config))
        config = EngineConfig(model, cache, scheduler, device)
        vllm_args.log_ignored(self)
        return config

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--flag` per field (dashes for underscores), with the same defaults:
        booleans as `--flag` / `--no-flag`, lists as `--flag A [B ...]`, dicts as JSON."""
        for f in dataclasses.fields(EngineArgs):
            flags = ["--" + f.name.replace("_", "-"), *_SHORT_FLAGS.get(f.name, ())]
            kwargs: dict[str, Any] = {"default": f.default, "help": _HELP.get(f.name)}
            if f.type == "bool":
                kwargs["action"] = argparse.BooleanOptionalAction
            elif f.name in _HUMAN_INTS:  # as vLLM: 2k is 2000, 2K is 2048
                kwargs.update(type=_HUMAN_INTS[f.name], metavar="N")
            elif f.type in _CLI_KINDS:
                kwargs.update(_CLI_KINDS[f.type])
            else:
                raise TypeError(f"EngineArgs.{f.name}: no CLI form for type {f.type!r}")
            if f.name in CHOICES:  # shown as {a,b}; checked when the config is built
                kwargs["metavar"] = "{" + ",".join(CHOICES[f.name]) + "}"
            parser.add_argument(*flags, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def human_int_or_auto(text: str) -> int | None:
    """human_int, or None (the model's own) for -1 and auto, as vLLM's --max-model-len."""
    return None if text.strip().lower() in ("auto", "-1") else human_int(text)


def human_int(text: str) -> int:
    """An int as vLLM's command line reads one: 1000, 1k (10^3), 1K (2^10), 25.6k, up to
    t/T."""
    scales = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
              "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, scale = (text[:-1], scales[text[-1]]) if text and text[-1] in scales else (text, 1)
    try:
        binary = text[-1:] in ("K", "M", "G", "T")  # 2K: whole numbers only, as vLLM
        value = int(number) * scale if binary else Decimal(number) * scale
        if not Decimal(value).is_finite() or value != int(value):
            raise ValueError
    except (ArithmeticError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a whole number such as 2048, 2k, 25.6k or "
                                         f"2K, got {text!r}") from None
    return int(value)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e


# How a field's type reads from the command line (bool fields: --flag / --no-flag).
_CLI_KINDS: dict[str, dict[str, Any]] = {
    "str": {"type": str}, "str | None": {"type": str},
    "int": {"type": int}, "int | None": {"type": int},
    "float": {"type": float}, "float | None": {"type": float},
    "str | list[str] | None": {"nargs": "+", "metavar": "NAME"},
    "HfOverrides | None": {"type": _json, "metavar": "JSON"},
    "int | dict | None": {"type": _json, "metavar": "LEVEL|JSON"},
    "dict | None": {"type": _json, "metavar": "JSON"},
}
# Fields read as human_int, and vLLM's short flags.
_HUMAN_INTS = {"max_model_len": human_int_or_auto, "max_num_batched_tokens": human_int,
               "kv_cache_memory_bytes": human_int}
_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",),
                "quantization": ("-q",), "compilation_config": ("-O",),
                "speculative_config": ("-sc",)}
# The values a choice field takes (validated by the config with a ValueError naming it).
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "scheduling_policy": ("fcfs", "priority"),
    "kv_failure_policy": ("recompute", "fail"),
    "device": ("auto", "cpu", "cuda"),
    "tokenizer_mode": TOKENIZER_MODES,
    "quantization": ("gguf",),
}
# On CPU a step's time grows with its tokens: 64 prompt tokens add about 40 ms (SmolLM2-135M,
# 2 cores) to the step every running stream waits for, 256 about 0.15 s. With 8 decodes (a
# 20 ms step) 64 keeps the pause short at no cost in throughput; with 32 or more (40 ms and up)
# 256 or more keep throughput 15% higher than 64 (benchmarks/results/serving_stalls.md).
CPU_PREFILL_TOKENS_WITH_DECODES = 64
CPU_PREFILL_TOKENS_PER_DECODE = 8
_IGNORED_HELP = "accepted for vLLM compatibility; ignored here (logged once)"
_HELP = {
    "model": f"the model: {DEFAULT_MODEL} (bundled), a Hugging Face directory or a .gguf file",
    "dtype": "weights' and activations' type; auto: float32 on CPU, the model's 16-bit type "
             "on CUDA",
    "seed": "the engine's random seed (sampling without a per-request seed)",
    "max_model_len": "longest prompt + output in tokens (default: the model's context length)",
    "block_size": "tokens per KV cache block (a power of two)",
    "kv_cache_memory_bytes": f"bytes for the KV cache, winning over the fractions (default: "
                             f"{CPU_DEFAULT_KV_BYTES >> 30} GiB on CPU whatever memory is free, "
                             f"an error if it is not available; on CUDA what "
                             f"--gpu-memory-utilization leaves after the weights)",
    "kv_cache_memory_fraction": "the KV cache as a share of memory instead: on CPU of total "
                                "RAM; on CUDA of the GPU's memory, weights included, as "
                                "--gpu-memory-utilization (default: none)",
    "gpu_memory_utilization": "on CUDA, the share of GPU memory the engine may use (weights "
                              "and KV cache); not used on CPU",
    "enable_prefix_caching": "reuse the KV blocks of earlier prompts' common prefixes",
    "kv_cache_prefault": "on CPU, touch every page of the KV cache when the engine starts "
                         "(seconds per GiB; the whole cache then resident, as vLLM's CPU "
                         "build always does), so that no step pays the page faults of a "
                         "block's first use (default: pages are mapped on first use)",
    "max_num_batched_tokens": "most tokens one engine step computes",
    "max_num_seqs": "most requests running at once",
    "scheduling_policy": "fcfs: first come, first served; priority: lower priority value first",
    "enable_chunked_prefill": "split long prompts across steps so that decodes keep going",
    "max_prefill_tokens_with_decodes": "most prompt tokens a step computes while requests are "
                                       "decoding: bounds the pause a new prompt puts into "
                                       "running streams (default: 64 on CPU, no bound on "
                                       "GPU)",
    "prefill_tokens_per_decode": "raise that bound to this many prompt tokens per decoding "
                                 "request when that is more (default: 8 on CPU)",
    "kv_lease_s": "seconds a prefill instance keeps a finished prompt's KV for the decode side",
    "kv_failure_policy": "when a KV pull fails: recompute the prompt on decode, or fail the "
                         "request",
    "device": "auto: cuda when available, else cpu",
    "tokenizer": "the tokenizer's directory or model (default: the model's)",
    "tokenizer_mode": "auto or hf: the fast tokenizer; slow: transformers' use_fast=False",
    "skip_tokenizer_init": "only False is supported",
    "chat_template": "a Jinja chat template, or a file holding one (default: the model's)",
    "max_logprobs": "the most logprobs / prompt_logprobs a request may ask for (-1: no cap)",
    "served_model_name": "the model name(s) the API answers to; the first one is reported",
    "hf_overrides": "JSON of config attributes overriding the model's config",
    "generation_config": "where requests' default sampling settings come from: auto (the "
                         "model's generation_config.json), vllm (none), or a folder",
    "speculative_config": "JSON of vLLM's speculative decoding settings; method ngram "
                          "(prompt lookup) only, e.g. {\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}: requests "
                          "compute drafted tokens in the same step and keep those the model "
                          "confirms (greedy and seeded: the same output; unseeded sampled: "
                          "the same distribution) (default: off)",
    "override_generation_config": "JSON of generation config fields set on top, e.g. "
                                  "{\"temperature\": 0.5}",
    "quantization": "none, or gguf for a .gguf model (dequantized when loaded)",
    "revision": "the revision of a Hugging Face repo id in the local cache (default: main)",
    "kv_cache_dtype": "only auto: the KV cache has the model's dtype",
    "load_format": "auto, safetensors or gguf (by the model's files)",
    "tensor_parallel_size": "only 1 is supported",
    "pipeline_parallel_size": "only 1 is supported",
    "disable_log_stats": "servers log no periodic stats (throughput, requests, KV cache usage "
                         "every 10 s while there is traffic); /metrics is unaffected",
    **{name: _IGNORED_HELP for name in vllm_args.ignored_names()},
}

