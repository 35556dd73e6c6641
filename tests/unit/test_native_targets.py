"""The native kernels' two builds (csrc/vec.h): 16 float32 lanes for an AVX-512 target, 8 for
an AVX2 one (with FMA and F16C), and none for other targets, where the torch kernels serve.

The library is compiled with -march=native, so the rest of the suite exercises only this
machine's build. Here a compiler wrapper (benchmarks/avx2_only/cc) turns -march=native into
-march=haswell: the engine must then build and load the 8-lane library, and the kernel tests
and greedy comparisons with transformers must pass on it (in a child process, whose engine
loads that build). A wrapper targeting plain x86-64 (no AVX2) must leave the torch kernels
serving without building anything.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels import native

ROOT = Path(__file__).parents[2]
HASWELL = str(ROOT / "benchmarks" / "avx2_only" / "cc")
# the kernel tests (coded weights included) run again on the AVX2 build, and the engine's
# greedy checks through the native layer loop (about 40 s in all here)
AVX2_SUITE = ["tests/unit/test_cpu_linear.py", "tests/unit/test_coded_weights.py",
              "tests/unit/test_cpu_decode.py",
              "tests/unit/test_cpu_prefill.py", "tests/unit/test_cpu_argmax.py",
              "tests/unit/test_cpu_fused.py", "tests/unit/test_cpu_layers.py",
              ("tests/engine/test_native_layers_hf.py::"
               "test_engine_matches_transformers_through_native_layers")]


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


def test_the_compilers_target_decides_the_lanes(tmp_path, monkeypatch):
    real = native._compiler()
    monkeypatch.setenv("REAL_CC", shlex.join(real))
    expected = (16 if "avx512f" in CPU_FLAGS else 8 if AVX2 <= CPU_FLAGS else None)
    assert native.vector_lanes(real) == expected
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


@pytest.mark.skipif(not AVX2 <= CPU_FLAGS, reason="this CPU cannot run AVX2 code")
def test_the_avx2_build_passes_the_kernel_tests(tmp_path):
    env = {**os.environ, "CC": HASWELL, "REAL_CC": shlex.join(native._compiler()),
           native.CACHE_ENV: str(tmp_path / "cache")}
    env.pop(native.DISABLE_ENV, None)
    probe = subprocess.run(
        [sys.executable, "-c", ("from pdserve.kernels import native; lib = native.load(); "
                                "print(lib.vector_lanes(), lib.linear_coded_supported())")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert probe.stdout.split() == ["8", "3"], probe.stderr[-2000:]  # every coded form too
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           *AVX2_SUITE], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900, check=False)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and "native kernels not built" not in tail, tail
