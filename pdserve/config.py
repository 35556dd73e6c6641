"""Engine configuration: frozen dataclasses, one per concern, validated once when built.

`EngineArgs` (engine/engine_args.py) is the user-facing bag of options; it resolves the model
and builds an `EngineConfig` exactly once. Nothing below re-parses options or reads the
environment, except `DeviceConfig.detect`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.ngram_drafts import SpeculativeConfig
from pdserve.models.arch import ModelArch
from pdserve.models.loader import ResolvedModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "half": torch.float16, "float": torch.float32}


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"

    @staticmethod
    def detect() -> DeviceConfig:
        return DeviceConfig("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class TokenizerConfig:
    """Where the tokenizer's files are, how to load them, and the chat template to use
    (the template's text; None: the tokenizer's own)."""

    source: ResolvedModel
    mode: str = "auto"  # "auto" / "hf": the fast tokenizer; "slow": the Python one
    chat_template: str | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, tokenizer and numeric type; `arch` is read from the model's config."""

    model: str  # what the user asked for
    resolved: ResolvedModel  # where its files are
    arch: ModelArch
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    # (SamplingParams field, value): the model's recommended settings (generation_defaults.py)
    sampling_defaults: tuple[tuple[str, Any], ...] = ()
    max_tokens_cap: int | None = None  # what a served request may ask for at most (None: any)
    tokenizer: TokenizerConfig | None = None  # None: the model's own, as is
    max_logprobs: int = 20  # per position, for logprobs and prompt_logprobs; -1: no cap
    served_model_name: tuple[str, ...] = ()  # names the API answers to; () means `model`

    def __post_init__(self) -> None:
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or non-negative, "
                             f"got {self.max_logprobs}")

    @property
    def served_name(self) -> str:
        """The name the API reports: the first served_model_name, else `model`."""
        return self.served_model_name[0] if self.served_model_name else self.model

    @property
    def tokenizer_config(self) -> TokenizerConfig:
        return self.tokenizer or TokenizerConfig(self.resolved)

    @staticmethod
    def resolve_dtype(dtype: str | torch.dtype, arch: ModelArch, device: str) -> torch.dtype:
        """'auto' means float32 on CPU (the fast path there) and the config's type on CUDA."""
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype == "auto":
            if device == "cpu":
                return torch.float32
            cfg = _DTYPES.get(arch.torch_dtype, torch.bfloat16)
            return torch.bfloat16 if cfg == torch.float32 else cfg
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: unsupported value {dtype!r} "
                             f"(choose auto, float32, bfloat16 or float16)")
        return _DTYPES[dtype]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how much memory the blocks may take."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # wins over both fractions (engine/kv_budget.py)
    # CUDA: the share of GPU memory for weights + KV cache (vLLM's); unused on CPU.
    gpu_memory_utilization: float = 0.92
    enable_prefix_caching: bool = True
    # CPU: the share of total RAM for the KV cache; CUDA: replaces gpu_memory_utilization.
    kv_cache_memory_fraction: float | None = None
    # CPU: fault every page of the cache in at start (kv_transfer/transport.py: prefault).
    kv_cache_prefault: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, "
                             f"got {self.kv_cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction (--kv-cache-memory-fraction) must be "
                             f"in (0, 1], got {fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and policy."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    policy: str = "fcfs"  # or "priority": lower value first, then arrival
    enable_chunked_prefill: bool = True
    # Disaggregation: how long a finished prefill's blocks wait for the decode side to read
    # them, and what the decode side does when a read fails ("recompute" or "fail").
    kv_lease_s: float = 30.0
    kv_failure_policy: str = "recompute"
    # Most prompt tokens one step computes while other requests are decoding (None: no bound
    # beyond max_num_batched_tokens): bounds the pause a new prompt puts into running streams.
    max_prefill_tokens_with_decodes: int | None = None
    # Raises that bound to this many prompt tokens per decoding request, when that is more: a
    # step of many decodes is long already, so the same prompt tokens stretch it less.
    prefill_tokens_per_decode: int | None = None
    # Speculative decoding by prompt lookup (engine/ngram_drafts.py); None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None and cap < 1:
            raise ValueError(f"max_prefill_tokens_with_decodes must be >= 1, got {cap}")
        per = self.prefill_tokens_per_decode
        if per is not None and per < 1:
            raise ValueError(f"prefill_tokens_per_decode must be >= 1, got {per}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.kv_lease_s <= 0:
            raise ValueError(f"kv_lease_s must be positive, got {self.kv_lease_s}")
        if self.kv_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_failure_policy must be 'recompute' or 'fail', "
                             f"got {self.kv_failure_policy!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig

    def __post_init__(self) -> None:
        if (not self.scheduler.enable_chunked_prefill
                and self.scheduler.max_num_batched_tokens < self.model.max_model_len):
            raise ValueError(
                f"max_num_batched_tokens ({self.scheduler.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.model.max_model_len}) without chunked prefill")


def kv_bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return arch.num_hidden_layers * 2 * block_size * arch.num_key_value_heads * arch.head_dim * elem


# (limit, usage, stat file, its reclaimable page cache) of cgroup v2 and v1, under the mount
CGROUP_MEMORY = (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                  "memory/memory.stat", "total_inactive_file"))


def available_memory_bytes(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Memory the OS reports as available, or what this process's cgroup (a container's
    memory limit) has left where that is less: the CPU KV cache must fit in it."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    for limit_file, usage_file, stat_file, cache_field in CGROUP_MEMORY:
        limit, usage = (_read_int(os.path.join(cgroup_root, f))
                        for f in (limit_file, usage_file))
        if limit is not None and usage is not None:
            usage -= _stat_field(os.path.join(cgroup_root, stat_file), cache_field)
            available = min(available, max(limit - usage, 0))
    return available


def total_memory_bytes(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The machine's RAM, or this process's cgroup memory limit where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file, *_ in CGROUP_MEMORY:
        limit = _read_int(os.path.join(cgroup_root, limit_file))
        if limit is not None:
            total = min(total, limit)
    return total


def _stat_field(path: str, name: str) -> int:
    """A field of a cgroup memory.stat file (0 when absent)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == name and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def _read_int(path: str) -> int | None:
    """The integer a cgroup file holds; None when absent or "max" (no limit)."""
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError:
        return None
    return int(value) if value.isdigit() else None
