"""The native kernels' two builds (csrc/vec.h): 16 float32 lanes for an AVX-512 target, 8 for
an AVX2 one (with FMA and F16C), and none for other targets, where the torch kernels serve.

The library is compiled with -march=native, so the rest of the suite exercises only this
machine's build. Here a compiler wrapper (benchmarks/avx2_only/cc) turns -march=native into
-march=haswell: the engine must then build and load the 8-lane library, its linear kernels
(float32 panels, silu-and-mul, every coded form) must give this build's results bit for bit
(each output is one multiply-add chain over the inputs, whatever the width), and the kernel
tests and greedy comparisons with transformers must pass on it (in child processes, whose
engine loads that build). A wrapper targeting plain x86-64 (no AVX2) must leave the torch
kernels serving without building anything.
"""

import ctypes
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_coded_weights import gguf_weight

from pdserve.kernels import native
from pdserve.kernels.coded_weights import encode
from pdserve.kernels.cpu_linear import pack_panels

ROOT = Path(__file__).parents[2]
HASWELL = str(ROOT / "benchmarks" / "avx2_only" / "cc")
# the kernel tests (coded weights included) run again on the AVX2 build, and the engine's
# greedy check through the native layer loop (about 20 s in all here)
AVX2_SUITE = ["tests/unit/test_cpu_linear.py", "tests/unit/test_coded_weights.py",
              "tests/unit/test_cpu_decode.py",
              "tests/unit/test_cpu_prefill.py", "tests/unit/test_cpu_argmax.py",
              "tests/unit/test_cpu_fused.py", "tests/unit/test_cpu_layers.py",
              ("tests/engine/test_native_layers_hf.py::"
               "test_engine_matches_transformers_through_native_layers[LlamaForCausalLM]")]


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty off Linux or off x86)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines
                 if line.startswith("flags")), set())


CPU_FLAGS = cpu_flags()
AVX2 = {"avx2", "fma", "f16c"}  # what the 8-lane build needs

pytestmark = pytest.mark.skipif(native._compiler() is None or not CPU_FLAGS,
                                reason="no C compiler, or not an x86 Linux CPU")


def wrapper_for(target: str, tmp_path: Path) -> str:
    """A compiler that targets `target` where it is asked for -march=native."""
    path = tmp_path / f"cc-{target}"
    path.write_text(Path(HASWELL).read_text().replace("-march=haswell", f"-march={target}"))
    path.chmod(0o755)
    return str(path)


def linear_outputs() -> dict[str, torch.Tensor]:
    """The loaded library's linear kernels on fixed inputs: last panels of 18 and 24 outputs
    (with 8 lanes, a second pass of 2 and 8), row counts around every group size, a bias."""
    lib, ptr = native.load(), ctypes.c_void_p
    k, results = 256, {}
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(0))
    weights = {"f32": torch.randn(120, k, generator=torch.Generator().manual_seed(1)) * 0.05,
               "q4": gguf_weight((120, k), Q.Q4_1, seed=2),
               "q8": gguf_weight((120, k), Q.Q8_0, seed=3),
               "bf16": (torch.randn(120, k, generator=torch.Generator().manual_seed(4))
                        * 0.05).bfloat16().float()}
    bias = torch.randn(120, generator=torch.Generator().manual_seed(5))
    for name, w in weights.items():
        coded = None if name == "f32" else encode(w)
        panels = pack_panels(w)
        for n in (50, 120):
            for rows in (1, 3, 4, 5, 6, 7, 13, 14, 15, 29, 40):
                out = torch.empty(rows, n)
                b = ptr(bias.data_ptr()) if rows % 2 else None
                if coded is None:
                    lib.linear_f32(ptr(x.data_ptr()), k, rows, ptr(panels.data_ptr()), n, k, b,
                                   ptr(out.data_ptr()), n, 2)
                else:  # the first n outputs' panels are the first ceil(n / 32) of the weight's
                    lib.linear_coded_f32(
                        ptr(x.data_ptr()), k, rows, ptr(coded.codes.data_ptr()),
                        None if coded.params is None else ptr(coded.params.data_ptr()),
                        coded.bits, n, k, b, ptr(out.data_ptr()), n, 2)
                results[f"{name}-{n}-{rows}"] = out
    gate_up = pack_panels(weights["f32"][:64])  # n = 32: gate outputs, then up
    for rows in (1, 6, 14, 40):
        out = torch.empty(rows, 32)
        assert lib.linear_silu_mul_f32(ptr(x.data_ptr()), k, rows, ptr(gate_up.data_ptr()), 32,
                                       k, ptr(out.data_ptr()), 32, 2) == 0
        results[f"silu-{rows}"] = out
    return results


def test_the_compilers_target_decides_the_lanes(tmp_path, monkeypatch):
    real = native._compiler()
    monkeypatch.setenv("REAL_CC", shlex.join(real))
    expected = (16 if "avx512f" in CPU_FLAGS else 8 if AVX2 <= CPU_FLAGS else None)
    assert native.vector_lanes(real) == expected
    if expected is not None:  # a build that fails would otherwise skip every kernel test
        assert native.load() is not None and native.load().vector_lanes() == expected
    assert native.vector_lanes([HASWELL]) == 8
    assert native.vector_lanes([wrapper_for("x86-64", tmp_path)]) is None
    assert native.vector_lanes([str(tmp_path / "no-such-compiler")]) is None


def test_a_target_without_avx2_leaves_the_torch_kernels(tmp_path, monkeypatch):
    """load() must refuse before building anything."""
    monkeypatch.setenv("REAL_CC", shlex.join(native._compiler()))
    monkeypatch.setenv("CC", wrapper_for("x86-64", tmp_path))
    cache = tmp_path / "cache"
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    assert native.load.__wrapped__() is None  # load() itself stays cached for other tests
    assert not cache.exists() or not any(cache.iterdir())


# run in the child: the AVX2 build's lanes and linear_outputs(), saved
PROBE = """import sys, torch
sys.path.insert(0, "tests/unit")
from test_native_targets import linear_outputs
from pdserve.kernels import native
torch.save(linear_outputs(), sys.argv[1])
print(native.load().vector_lanes())
"""


@pytest.mark.skipif(not AVX2 <= CPU_FLAGS, reason="this CPU cannot run AVX2 code")
def test_the_avx2_build_passes_the_kernel_tests(tmp_path):
    env = {**os.environ, "CC": HASWELL, "REAL_CC": shlex.join(native._compiler()),
           native.CACHE_ENV: str(tmp_path / "cache")}
    env.pop(native.DISABLE_ENV, None)
    saved = tmp_path / "linear.pt"
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(saved)], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=300, check=False)
    assert probe.stdout.split() == ["8"], probe.stderr[-2000:]
    if native.load() is not None:
        theirs, ours = torch.load(saved), linear_outputs()
        assert theirs.keys() == ours.keys()
        for key, out in ours.items():
            assert torch.equal(theirs[key].view(torch.int32), out.view(torch.int32)), key
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           *AVX2_SUITE], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900, check=False)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail  # every test ran on the build
