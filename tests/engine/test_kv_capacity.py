"""The KV cache's size is predictable: on CPU the default is exactly CPU_DEFAULT_KV_BYTES
whatever memory is free (an error naming --kv-cache-memory-bytes when it is not available),
--kv-cache-memory-fraction is a share of total RAM, and --kv-cache-memory-bytes wins."""

from __future__ import annotations

import pytest

from pdserve import config as cfg
from pdserve.cli import build_parser
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.kv_budget import CPU_DEFAULT_KV_BYTES, num_kv_blocks
from pdserve.engine.llm_engine import LLMEngine
from pdserve.gateway.server import serve_engine_args


def per_block(config) -> int:
    return cfg.kv_bytes_per_block(config.model.arch, config.cache.block_size,
                                  config.model.dtype)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_default_is_the_same_for_every_engine_whatever_memory_is_free(tiny_model_dir,
                                                                      monkeypatch):
    # Before, the default was min(4 GiB, free // 4): 1.25 GiB, then 4 GiB, here.
    blocks, expected = [], None
    for free in (5 << 30, 20 << 30):
        monkeypatch.setattr(cfg, "available_memory_bytes", lambda free=free: free)
        before = rss_bytes()
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), device="cpu"))
        # Allocated, but its pages are only touched as blocks are used.
        assert rss_bytes() - before < CPU_DEFAULT_KV_BYTES // 4
        expected = CPU_DEFAULT_KV_BYTES // per_block(engine.config)
        blocks.append(engine.num_blocks)
        assert engine.block_pool.num_blocks == engine.num_blocks
        assert engine.kv_cache_bytes == engine.num_blocks * per_block(engine.config)
        assert f"{engine.num_blocks} blocks of 16 tokens" in engine.describe()
        assert "4.00 GiB" in engine.describe()
        del engine
    assert blocks == [expected, expected]


def test_default_that_does_not_fit_fails_naming_the_flag(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(cfg, "available_memory_bytes", lambda: 1 << 30)
    config = EngineArgs(model=str(tiny_model_dir), device="cpu").create_engine_config()
    with pytest.raises(ValueError, match="4.00 GiB .*does not fit in the 1.00 GiB .*"
                                         "--kv-cache-memory-bytes"):
        num_kv_blocks(config)


def test_fraction_of_total_memory_and_bytes_win(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(cfg, "total_memory_bytes", lambda: 8 << 30)
    monkeypatch.setattr(cfg, "available_memory_bytes", lambda: 6 << 30)
    args = serve_engine_args(build_parser().parse_args(
        ["serve", str(tiny_model_dir), "--device", "cpu", "--kv-cache-memory-fraction", "0.25"]))
    assert args.kv_cache_memory_fraction == 0.25
    config = args.create_engine_config()
    assert num_kv_blocks(config) == (2 << 30) // per_block(config)
    args.kv_cache_memory_bytes = 1 << 20
    config = args.create_engine_config()
    assert num_kv_blocks(config) == (1 << 20) // per_block(config)
    args.kv_cache_memory_bytes, args.kv_cache_memory_fraction = None, 0.9  # 7.2 of 6 GiB free
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes"):
        num_kv_blocks(args.create_engine_config())


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.1])
def test_fraction_outside_0_1_is_an_error_naming_the_flag(tiny_model_dir, fraction):
    with pytest.raises(ValueError, match="--kv-cache-memory-fraction"):
        EngineArgs(model=str(tiny_model_dir), kv_cache_memory_fraction=fraction
                   ).create_engine_config()


def test_too_small_a_budget_names_the_flag(tiny_model_dir):
    config = EngineArgs(model=str(tiny_model_dir), device="cpu",
                        kv_cache_memory_bytes=100).create_engine_config()
    with pytest.raises(ValueError, match="hold no KV block.*--kv-cache-memory-bytes"):
        num_kv_blocks(config)


def test_cuda_fraction_keeps_gpu_memory_utilization_meaning(tiny_model_dir, monkeypatch):
    """On CUDA (its memory query faked): the engine's share of the GPU less what is in use."""
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 << 30, 80 << 30))

    def blocks(**kwargs) -> tuple[int, int]:
        config = EngineArgs(model=str(tiny_model_dir), device="cuda",
                            **kwargs).create_engine_config()
        return num_kv_blocks(config), per_block(config)

    got, size = blocks(gpu_memory_utilization=0.5)
    assert got == ((40 << 30) - (10 << 30)) // size
    got, size = blocks(gpu_memory_utilization=0.9, kv_cache_memory_fraction=0.25)
    assert got == ((20 << 30) - (10 << 30)) // size  # the fraction replaces it
    got, size = blocks(kv_cache_memory_fraction=0.25, kv_cache_memory_bytes=1 << 20)
    assert got == (1 << 20) // size


@pytest.mark.parametrize("v2", [True, False])
def test_a_containers_memory_limit_bounds_what_the_cache_may_take(tmp_path, v2):
    """Inside a container the host's MemAvailable overstates what this process may use: the
    cgroup's limit less its usage (less reclaimable page cache) counts too."""
    gib = 1 << 30
    folder = tmp_path if v2 else tmp_path / "memory"
    folder.mkdir(exist_ok=True)
    names = (("memory.max", "memory.current", "memory.stat", "inactive_file") if v2 else
             ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat",
              "total_inactive_file"))
    (folder / names[0]).write_text(f"{4 * gib}\n")
    (folder / names[1]).write_text(f"{3 * gib}\n")
    (folder / names[2]).write_text(f"anon 123\n{names[3]} {gib // 2}\n")
    assert cfg.available_memory_bytes(str(tmp_path)) == gib + gib // 2
    assert cfg.total_memory_bytes(str(tmp_path)) == 4 * gib
    (folder / names[0]).write_text("max\n")  # no limit: the host's figures
    assert cfg.total_memory_bytes(str(tmp_path)) == cfg.total_memory_bytes(str(tmp_path / "x"))
