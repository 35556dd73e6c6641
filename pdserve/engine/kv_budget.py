"""How much memory an engine's KV cache gets, and so how many blocks it has.

Predictable by default, as vLLM's CPU build is (VLLM_CPU_KVCACHE_SPACE, 4 GiB): on CPU the
cache is CPU_DEFAULT_KV_BYTES whatever memory happens to be free when the engine starts, so
every instance of a cluster has the same number of blocks. In order of precedence:

- `kv_cache_memory_bytes` (--kv-cache-memory-bytes): exactly that many bytes;
- `kv_cache_memory_fraction` F (--kv-cache-memory-fraction): on CPU, F of the machine's total
  RAM (its cgroup limit if lower); on CUDA, vLLM's `gpu_memory_utilization` meaning: the
  engine may use F of the GPU's memory, weights included, and the cache gets what is left;
- neither: CPU_DEFAULT_KV_BYTES on CPU, `gpu_memory_utilization` on CUDA.

On CPU a budget larger than the memory available at start fails with a ValueError naming
--kv-cache-memory-bytes, rather than shrinking silently (the cache's pages are only touched as
blocks are used, so an oversized cache would otherwise fail later, under load).

Importing this module does not import torch (`pdserve --help` reads CPU_DEFAULT_KV_BYTES).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.config import EngineConfig

CPU_DEFAULT_KV_BYTES = 4 << 30
_FLAGS = "--kv-cache-memory-bytes (or --kv-cache-memory-fraction)"


def gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


def kv_cache_budget(config: EngineConfig) -> tuple[int, str]:
    """The KV cache's bytes, and where that number came from (for messages)."""
    from pdserve import config as cfg

    cache = config.cache
    if cache.kv_cache_memory_bytes is not None:
        budget, source = cache.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    elif config.device.device == "cuda":
        import torch

        fraction = cache.kv_cache_memory_fraction or cache.gpu_memory_utilization
        free, total = torch.cuda.mem_get_info()
        # vLLM's meaning: the engine's share of the GPU, less what is in use already
        # (this engine's weights included).
        return int(total * fraction) - (total - free), f"{fraction:g} of the GPU's memory"
    elif cache.kv_cache_memory_fraction is not None:
        fraction = cache.kv_cache_memory_fraction
        budget = int(cfg.total_memory_bytes() * fraction)
        source = f"--kv-cache-memory-fraction {fraction:g} of total memory"
    else:
        budget, source = CPU_DEFAULT_KV_BYTES, "the CPU default"
    available = cfg.available_memory_bytes()
    if budget > available:
        raise ValueError(f"KV cache: {gib(budget)} ({source}) does not fit in the "
                         f"{gib(available)} of memory available; give a smaller {_FLAGS}")
    return budget, source


def num_kv_blocks(config: EngineConfig) -> int:
    """How many KV blocks the engine's budget holds (kv_cache_budget)."""
    from pdserve.config import kv_bytes_per_block

    per_block = kv_bytes_per_block(config.model.arch, config.cache.block_size, config.model.dtype)
    budget, source = kv_cache_budget(config)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"KV cache: {budget} bytes ({source}) hold no KV block "
                         f"({per_block} bytes each); give a larger {_FLAGS}")
    return int(blocks)
