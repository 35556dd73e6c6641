"""The native kernels' builds (csrc/vec.h): 16 float32 lanes for an AVX-512 target, 8 for an
AVX2 one (with FMA and F16C), 4 for other x86-64 targets (SSE2) and Arm's NEON, and none for
a target without such vectors, where the torch kernels serve.

The library is compiled with -march=native, so the rest of the suite exercises only this
machine's build. Here compiler wrappers turn -march=native into another target
(benchmarks/avx2_only/cc: -march=haswell), and the engine must then build and load that
target's library in a child process. Where the target multiplies and adds in one rounding
(FMA: AVX2, and on 4 lanes x86-64-v2 with FMA, as Arm's NEON does), its linear kernels
(float32 panels, silu-and-mul, every coded form) must give this build's results bit for bit:
each output is one multiply-add chain over the inputs, whatever the width. Plain x86-64 has
no FMA, so its results may differ in the last bits. The kernel tests must pass on the AVX2
build and on plain x86-64's 4 lanes (on an AVX2 host the AVX2 build is this machine's, and the
rest of the suite runs them on it); PDSERVE_SLOW_TESTS=1 adds a greedy comparison with
transformers through the engine on each, and x86-64-v2 with FMA's kernel tests.
test_native_arm.py builds for Arm. A 32-bit target
without SSE2 must leave the torch kernels serving without building anything.
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

from pdserve.cache_dir import CACHE_ENV
from pdserve.kernels import native
from pdserve.kernels.coded_weights import encode
from pdserve.kernels.cpu_linear import pack_panels

ROOT = Path(__file__).parents[2]
HASWELL = str(ROOT / "benchmarks" / "avx2_only" / "cc")
SLOW = bool(os.environ.get("PDSERVE_SLOW_TESTS"))
# the kernel tests (coded weights included) run again on the AVX2 build, and with
# PDSERVE_SLOW_TESTS=1 the engine's greedy check through the native layer loop
AVX2_SUITE = ["tests/unit/test_cpu_linear.py", "tests/unit/test_coded_weights.py",
              "tests/unit/test_cpu_decode.py",
              "tests/unit/test_cpu_prefill.py", "tests/unit/test_cpu_argmax.py",
              "tests/unit/test_cpu_fused.py", "tests/unit/test_cpu_layers.py",
              *([("tests/engine/test_native_layers_hf.py::"
                  "test_engine_matches_transformers_through_native_layers[LlamaForCausalLM]")]
                if SLOW else [])]


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


def wrapper_for(flags: list[str], tmp_path: Path) -> str:
    """A compiler that takes `flags` where it is asked for -march=native."""
    path = tmp_path / ("cc" + "".join(flags))
    path.write_text("#!/bin/sh\n"
                    "for a do shift\n"
                    f'  if [ "$a" = -march=native ]; then set -- "$@" {shlex.join(flags)}\n'
                    '  else set -- "$@" "$a"; fi\n'
                    "done\n"
                    'exec ${REAL_CC:-gcc} "$@"\n')
    path.chmod(0o755)
    return str(path)


SSE2 = ["-march=x86-64"]                  # every x86-64 CPU: 4 lanes, no FMA
SSE_FMA = ["-march=x86-64-v2", "-mfma"]   # 4 lanes with FMA, as on Arm
NO_VECTORS = ["-m32", "-march=i386"]      # no SSE2: no native build


ROWS = (1, 3, 4, 5, 6, 7, 13, 14, 15, 29, 40)  # around every group size
OUTPUTS = (50, 120)  # last panels of 18 and 24 outputs: partial passes at every width
SILU_ROWS = (1, 6, 14, 40)


FORMS = {"f32": None, "q4": 4, "q4-tiny": 4, "q8": 8, "bf16": 16}  # weight: its coded form


def tiny_q4_weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A 4-bit coded weight whose scales and offsets are float16 subnormals (multiples of
    2^-24 below 2^-14), which every width must widen exactly."""
    g = torch.Generator().manual_seed(seed)
    runs = shape[0] * shape[1] // 32
    codes = torch.randint(0, 16, (runs, 32), generator=g)
    codes[:, 0], codes[:, 1] = 0, 15  # each run spans 0 .. 15: its scale is (max - min) / 15
    scales = torch.randint(1, 1024, (runs, 1), generator=g) * 2.0 ** -24
    offsets = torch.randint(-1023, 1024, (runs, 1), generator=g) * 2.0 ** -24
    return (codes * scales + offsets).float().view(shape)


def linear_inputs() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Fixed inputs x (40, 256), weights (120, 256) in every coded form (FORMS), and a bias
    (120,)."""
    k = 256
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(0))
    weights = {"f32": torch.randn(120, k, generator=torch.Generator().manual_seed(1)) * 0.05,
               "q4": gguf_weight((120, k), Q.Q4_1, seed=2),
               "q4-tiny": tiny_q4_weight((120, k), seed=6),
               "q8": gguf_weight((120, k), Q.Q8_0, seed=3),
               "bf16": (torch.randn(120, k, generator=torch.Generator().manual_seed(4))
                        * 0.05).bfloat16().float()}
    return x, weights, torch.randn(120, generator=torch.Generator().manual_seed(5))


def linear_outputs() -> dict[str, torch.Tensor]:
    """The loaded library's linear kernels on linear_inputs(): every weight form at OUTPUTS
    and ROWS (a bias for odd row counts), silu-and-mul at SILU_ROWS."""
    lib, ptr = native.load(), ctypes.c_void_p
    x, weights, bias = linear_inputs()
    k, results = x.shape[1], {}
    for name, w in weights.items():
        coded = None if name == "f32" else encode(w)
        assert (coded and coded.bits) == FORMS[name], name
        panels = pack_panels(w)
        for n in OUTPUTS:
            for rows in ROWS:
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
    for rows in SILU_ROWS:
        out = torch.empty(rows, 32)
        assert lib.linear_silu_mul_f32(ptr(x.data_ptr()), k, rows, ptr(gate_up.data_ptr()), 32,
                                       k, ptr(out.data_ptr()), 32, 2) == 0
        results[f"silu-{rows}"] = out
    return results


def test_the_compilers_target_decides_the_lanes(tmp_path, monkeypatch):
    real = native._compiler()
    monkeypatch.setenv("REAL_CC", shlex.join(real))
    expected = (16 if "avx512f" in CPU_FLAGS else 8 if AVX2 <= CPU_FLAGS else 4)
    assert native.vector_lanes(real) == expected
    # a build that fails would otherwise skip every kernel test
    assert native.load() is not None and native.load().vector_lanes() == expected
    assert native.vector_lanes([HASWELL]) == 8
    assert native.vector_lanes([wrapper_for(SSE2, tmp_path)]) == 4
    assert native.vector_lanes([wrapper_for(SSE_FMA, tmp_path)]) == 4
    assert native.vector_lanes([wrapper_for(NO_VECTORS, tmp_path)]) is None
    assert native.vector_lanes([str(tmp_path / "no-such-compiler")]) is None


def test_a_target_without_vectors_leaves_the_torch_kernels(tmp_path, monkeypatch):
    """load() must refuse before building anything."""
    monkeypatch.setenv("REAL_CC", shlex.join(native._compiler()))
    monkeypatch.setenv("CC", wrapper_for(NO_VECTORS, tmp_path))
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    assert native.load.__wrapped__() is None  # load() itself stays cached for other tests
    assert not cache.exists() or not any(cache.iterdir())


# run in the child: the build's lanes, the engine's coded rows and linear_outputs(), saved
PROBE = """import sys, torch
sys.path.insert(0, "tests/unit")
from test_native_targets import linear_outputs
from pdserve.kernels import cpu_linear, native
torch.save(linear_outputs(), sys.argv[1])
print(native.load().vector_lanes(), cpu_linear.coded_max_rows())
"""
# name: (-march=native becomes these flags (None: the haswell wrapper), the CPU flags its code
# needs, its lanes, whether it rounds once a multiply-add, the kernel tests run on it)
TARGETS = {
    "avx2": (None, AVX2, 8, True, AVX2_SUITE),
    "sse2": (SSE2, {"sse2"}, 4, False, AVX2_SUITE),
    # by default its linear results only
    "sse-fma": (SSE_FMA, {"sse4_2", "popcnt", "avx", "fma"}, 4, True,
                AVX2_SUITE if SLOW else []),
}


def suite_on(target: str) -> list[str]:
    """The kernel tests a target's child runs: none where the target has this machine's own
    lanes (an AVX2 host's build is the AVX2 build: the rest of the suite runs them on it)."""
    _, _, lanes, _, suite = TARGETS[target]
    return [] if lanes == native.load().vector_lanes() else suite


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """Each target's child (its build and linear results, then its kernel tests), all started
    at once so that they run side by side; name -> (process, its folder)."""
    started = {}
    for name, (flags, needs, _, _, _) in TARGETS.items():
        if not needs <= CPU_FLAGS or native.load() is None:
            continue
        suite = suite_on(name)
        folder = tmp_path_factory.mktemp(name)
        env = {**os.environ, "REAL_CC": shlex.join(native._compiler()),
               "CC": HASWELL if flags is None else wrapper_for(flags, folder),
               CACHE_ENV: str(folder / "cache")}
        env.pop(native.DISABLE_ENV, None)
        script = (f"{shlex.join([sys.executable, '-c', PROBE, str(folder / 'linear.pt')])}"
                  f" > {folder / 'probe.out'} 2> {folder / 'probe.err'}")
        if suite:
            tests = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                     *suite]
            script += f" && {shlex.join(tests)} > {folder / 'suite.out'} 2>&1"
        started[name] = (subprocess.Popen(["sh", "-c", script], env=env, cwd=ROOT), folder)
    yield started
    for process, _ in started.values():
        process.kill()
        process.wait()


@pytest.mark.parametrize("target", TARGETS)
def test_a_build_passes_the_kernel_tests(children, target):
    _, needs, lanes, fma, _ = TARGETS[target]
    if not needs <= CPU_FLAGS:
        pytest.skip(f"this CPU cannot run the build's code: it lacks {needs - CPU_FLAGS}")
    if native.load() is None:
        pytest.skip(f"{native.DISABLE_ENV}=0: no build here to compare with")
    process, folder = children[target]
    process.wait(timeout=900)
    # the engine takes the coded weights for up to 16 rows on 8 lanes, and not on 4
    assert (folder / "probe.out").read_text().split() == [str(lanes), str({8: 16, 4: 0}[lanes])], \
        (folder / "probe.err").read_text()[-2000:]
    theirs, ours = torch.load(folder / "linear.pt"), linear_outputs()
    assert theirs.keys() == ours.keys()
    for key, out in ours.items():
        if fma:
            assert torch.equal(theirs[key].view(torch.int32), out.view(torch.int32)), key
        else:  # two roundings a step instead of one
            torch.testing.assert_close(theirs[key], out, rtol=1e-5, atol=1e-5, msg=key)
    if suite_on(target):
        tail = (folder / "suite.out").read_text()[-4000:]
        assert process.returncode == 0, tail
        assert " passed" in tail and "skipped" not in tail, tail  # every test ran on the build
