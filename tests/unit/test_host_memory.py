"""A CPU engine keeps freed activation memory for its next step (host_memory.py): a block of
40 MB, allocated, written and freed over and over, stops faulting its pages in once glibc's
heap has settled (a few rounds), where glibc's defaults map it afresh and fault in every page
each time; `release_freed_memory` (the engine's sleep) gives such memory back. Each case runs
in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHILD = """
import json, resource, sys
import torch
mode = sys.argv[1]
kept = None
if mode == "keep":
    from pdserve.engine.host_memory import keep_freed_memory
    kept = keep_freed_memory()
elif mode == "release":
    from pdserve.engine.host_memory import keep_freed_memory, release_freed_memory
    kept = keep_freed_memory()
    def resident():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    block = torch.ones(50 << 20)  # 200 MB
    before = resident()
    del block
    freed = resident()
    release_freed_memory()
    print(json.dumps({"kept": kept, "held_after_free": before - freed < (100 << 20),
                      "released": freed - resident() > (150 << 20)}))
    sys.exit()
elif mode == "engine":
    from pdserve import LLM
    LLM(sys.argv[2], dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 22)
numel = 10 << 20  # 40 MB of float32: above glibc's largest automatic mmap threshold
for _ in range(24):  # allocated, written and freed while the heap settles
    torch.ones(numel)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    torch.ones(numel)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"kept": kept, "faults": faults, "pages": numel * 4 // 4096}))
"""

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux")
                                or not os.confstr("CS_GNU_LIBC_VERSION"),
                                reason="glibc's malloc only")


def _child(*args: str, env: dict | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True,
                         check=True, env={**clean, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_freed_block_is_reused_without_page_faults():
    default, kept = _child("default"), _child("keep")
    assert default["faults"] > 7 * default["pages"]  # glibc's default: mapped afresh each time
    assert kept["kept"] is True
    assert kept["faults"] < kept["pages"] // 2


@glibc_only
def test_glibc_environment_wins():
    out = _child("keep", env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert out["faults"] > 7 * out["pages"]


@glibc_only
def test_cpu_engine_keeps_freed_memory(tiny_model_dir):
    out = _child("engine", str(tiny_model_dir))
    assert out["faults"] < out["pages"] // 2


@glibc_only
def test_release_gives_freed_memory_back():
    out = _child("release")
    assert out == {"kept": True, "held_after_free": True, "released": True}
