"""--kv-cache-prefault: every page of the CPU KV cache is resident once the engine starts, the
cache still reads as zeros, and generation is unchanged; without it pages map on first use."""

from __future__ import annotations

import argparse

import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.engine_args import EngineArgs
from pdserve.kv_transfer.transport import prefault, zeroed_kv_cache


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s mapping that are in memory (from /proc/self/smaps)."""
    start = t.data_ptr()
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        first = line.split()[0]
        if "-" in first and all(c in "0123456789abcdef-" for c in first):
            lo, hi = (int(x, 16) for x in first.split("-"))
            if lo <= start < hi:
                for entry in lines[i + 1:]:
                    if entry.startswith("Rss:"):
                        return int(entry.split()[1]) * 1024
    raise AssertionError("mapping not found")


def test_prefault_makes_every_page_resident_and_keeps_zeros():
    cache = zeroed_kv_cache((2, 2, 256, 16, 2, 64), torch.float32)  # 16 MiB
    size = cache.numel() * cache.element_size()
    assert resident_bytes(cache) < size // 4  # lazily mapped
    prefault(cache)
    assert resident_bytes(cache) >= size
    assert not cache.any()


def test_engine_flag_prefaults_its_cache(tiny_model_dir):
    args = EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser())
                                    .parse_args(["--kv-cache-prefault"]))
    assert args.kv_cache_prefault
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 40))}
    outputs = []
    for flag in (False, True):
        llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=32 << 20, kv_cache_prefault=flag)
        outputs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        cache = llm.llm_engine.runner.kv_cache
        size = cache.numel() * cache.element_size()
        assert (resident_bytes(cache) >= size) == flag
        del llm, cache
    assert outputs[0] == outputs[1]
