"""EngineArgs: the user's options (keyword arguments or CLI flags), turned into a frozen
EngineConfig exactly once."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from pdserve.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig,
                            SchedulerConfig, available_memory_bytes, kv_bytes_per_block)
from pdserve.models.loader import DEFAULT_MODEL, load_arch, resolve_model

CPU_DEFAULT_KV_BYTES = 4 << 30


@dataclass
class EngineArgs:
    """Options for one engine, with vLLM's names where vLLM has them."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.92
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    kv_lease_s: float = 30.0
    kv_failure_policy: str = "recompute"
    device: str = "auto"

    def create_engine_config(self) -> EngineConfig:
        resolved = resolve_model(self.model)
        arch = load_arch(resolved)
        device = DeviceConfig.detect() if self.device == "auto" else DeviceConfig(self.device)
        max_len = self.max_model_len or arch.max_position_embeddings
        if not 1 < max_len <= arch.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {arch.max_position_embeddings}], "
                             f"got {max_len}")
        model = ModelConfig(
            model=self.model, resolved=resolved, arch=arch,
            dtype=ModelConfig.resolve_dtype(self.dtype, arch, device.device),
            max_model_len=max_len, seed=self.seed)
        cache = CacheConfig(self.block_size, self.kv_cache_memory_bytes,
                            self.gpu_memory_utilization, self.enable_prefix_caching)
        scheduler = SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                                    self.scheduling_policy, self.enable_chunked_prefill,
                                    self.kv_lease_s, self.kv_failure_policy)
        return EngineConfig(model, cache, scheduler, device)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--flag` per field (dashes for underscores), with the same defaults."""
        for f in dataclasses.fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                    default=f.default)
            else:
                kind = {"int": int, "float": float, "int | None": int}.get(f.type, str)
                parser.add_argument(flag, type=kind, default=f.default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def num_kv_blocks(config: EngineConfig) -> int:
    """How many KV blocks fit: `kv_cache_memory_bytes` if given, else a share of memory."""
    per_block = kv_bytes_per_block(config.model.arch, config.cache.block_size, config.model.dtype)
    budget = config.cache.kv_cache_memory_bytes
    if budget is None:
        if config.device.device == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info()
            budget = int(total * config.cache.gpu_memory_utilization) - (total - free)
        else:
            budget = min(CPU_DEFAULT_KV_BYTES, available_memory_bytes() // 4)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes: {budget} bytes hold no KV block "
                         f"({per_block} bytes each)")
    return int(blocks)
