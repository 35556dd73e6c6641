"""Native kernels built for CPUs other than this one (csrc/linear.c, linear_coded.c,
paged_decode.c).

The library is compiled with -march=native, so a test run exercises only this machine's
vector path. Here the kernels are also compiled for AVX2 with F16C (haswell) and for plain
x86-64 (the scalar fallbacks) and run on this CPU: every coded form must give that build's
float32 panels' results bit for bit (x86-64's with PDSERVE_SLOW_TESTS=1), and decode attention
must match a float64 reference. Those builds are tested, but an engine does not load them:
a compiler that does not target AVX-512 leaves the torch kernels serving.
"""

import ctypes
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from test_coded_weights import gguf_weight
from test_cpu_decode import paged, reference

from pdserve.kernels import native
from pdserve.kernels.coded_weights import encode
from pdserve.kernels.cpu_linear import pack_panels

CSRC = Path(native.__file__).parent / "csrc"


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty off Linux or off x86)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines
                 if line.startswith("flags")), set())


CPU_FLAGS = cpu_flags()
# target -> (CPU flags it needs to run here, what linear_coded_supported says of it)
TARGETS = {"haswell": ({"avx2", "fma", "f16c"}, 3), "x86-64": (set(), 0)}

pytestmark = pytest.mark.skipif(native._compiler() is None or not CPU_FLAGS,
                                reason="no C compiler, or not an x86 Linux CPU")


# Building linear.c and linear_coded.c takes half a minute a target here: the default run
# builds the AVX2 one, PDSERVE_SLOW_TESTS=1 the scalar fallbacks too.
LINEAR_TARGETS = ("haswell", "x86-64") if os.environ.get("PDSERVE_SLOW_TESTS") else ("haswell",)


def build(target: str, out_dir: Path, sources=("linear.c", "linear_coded.c")) -> ctypes.CDLL:
    return ctypes.CDLL(str(_wait(_start_build(target, out_dir, sources))))


def _start_build(target: str, out_dir: Path, sources) -> tuple[list, list[Path], Path]:
    """One compiler a source, started: (processes, object files, the library to link)."""
    flags = [f for f in native.FLAGS if f not in ("-march=native", "-shared")]
    objects = [out_dir / f"{Path(s).stem}-{target}.o" for s in sources]
    procs = [subprocess.Popen([*native._compiler(), *flags, f"-march={target}", "-Wno-psabi",
                               "-c", str(CSRC / s), "-o", str(o)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for s, o in zip(sources, objects)]
    return procs, objects, out_dir / f"{Path(sources[0]).stem}-{target}.so"


def _wait(started: tuple[list, list[Path], Path]) -> Path:
    """Wait for the compilers (none is left running if one fails), then link."""
    procs, objects, out = started
    try:
        for proc in procs:
            log = proc.communicate(timeout=300)[0]
            assert proc.returncode == 0, log.decode(errors="replace")[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    subprocess.run([*native._compiler(), "-shared", "-fopenmp", *map(str, objects), "-o",
                    str(out)], check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def linear_libs(tmp_path_factory) -> dict[str, Path]:
    """linear.c and linear_coded.c built for the LINEAR_TARGETS this CPU runs, every source
    compiled side by side."""
    out_dir = tmp_path_factory.mktemp("targets")
    runnable = [t for t in LINEAR_TARGETS if TARGETS[t][0] <= CPU_FLAGS]
    started = [_start_build(t, out_dir, ("linear.c", "linear_coded.c")) for t in runnable]
    try:
        return {t: _wait(s) for t, s in zip(runnable, started)}
    finally:
        for procs, _, _ in started:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_coded_form_equals_the_panels_on_other_targets(target, linear_libs):
    needs, supported = TARGETS[target]
    if not needs <= CPU_FLAGS:
        pytest.skip(f"this CPU cannot run {target} code")
    if target not in LINEAR_TARGETS:
        pytest.skip(f"set PDSERVE_SLOW_TESTS=1 to build linear.c for {target} too (~35 s)")
    if native.load() is None:
        pytest.skip("the coded forms are found by the native library: AVX-512 only")
    lib = ctypes.CDLL(str(linear_libs[target]))
    assert lib.linear_coded_supported() == supported
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    torch.manual_seed(0)
    weights = {4: gguf_weight((100, 256), Q.Q4_1, seed=1),
               8: gguf_weight((100, 256), Q.Q8_0, seed=2),
               16: (torch.randn(100, 256) * 0.05).bfloat16().float()}
    for bits, w in weights.items():
        coded = encode(w)  # the layouts do not depend on the target
        assert coded is not None and coded.bits == bits
        panels = pack_panels(w)
        for rows in (1, 3, 10, 17, 32):
            x = torch.randn(rows, 256)
            coded_out, panels_out = torch.empty(rows, 100), torch.empty(rows, 100)
            lib.linear_coded_f32(
                ptr(x.data_ptr()), i64(256), i64(rows), ptr(coded.codes.data_ptr()),
                None if coded.params is None else ptr(coded.params.data_ptr()),
                ctypes.c_int(bits), i64(100), i64(256), None, ptr(coded_out.data_ptr()),
                i64(100), ctypes.c_int(2))
            lib.linear_f32(ptr(x.data_ptr()), i64(256), i64(rows), ptr(panels.data_ptr()),
                           i64(100), i64(256), None, ptr(panels_out.data_ptr()), i64(100),
                           ctypes.c_int(2))
            assert torch.equal(coded_out.view(torch.int32), panels_out.view(torch.int32)), (
                bits, rows)
            torch.testing.assert_close(coded_out.double(), F.linear(x.double(), w.double()),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_decode_attention_on_other_targets(target, tmp_path):
    needs, _ = TARGETS[target]
    if not needs <= CPU_FLAGS:
        pytest.skip(f"this CPU cannot run {target} code")
    lib = build(target, tmp_path, ("paged_decode.c",))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lens = [1, 16, 17, 47, 130]  # shorter than the blocks fetched ahead, and longer
    for h, kvh, d in [(9, 3, 64), (14, 2, 64), (8, 2, 128)]:  # query heads grouped 3, 4 + 3, 2
        k_cache, v_cache, tables = paged(lens, h, kvh, d, 16, seed=h)
        q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(d))
        out = torch.empty_like(q)
        lengths, rows = torch.tensor(lens), torch.arange(len(lens))
        code = lib.paged_decode_f32(
            ptr(q.data_ptr()), i64(h * d), ptr(k_cache.data_ptr()), ptr(v_cache.data_ptr()),
            i64(k_cache.shape[0]), i64(16), i64(kvh), i64(d), ptr(tables.data_ptr()),
            i64(tables.shape[1]), ptr(lengths.data_ptr()), ptr(rows.data_ptr()), i64(len(lens)),
            i64(h), ctypes.c_float(d ** -0.5), ptr(out.data_ptr()), ctypes.c_int(2))
        assert code == 0
        want = reference(q, k_cache, v_cache, tables, lens, d ** -0.5)
        torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)


def test_a_compiler_without_avx512_leaves_the_torch_kernels(tmp_path, monkeypatch):
    """The real compiler, told to target haswell (AVX2) where it is told -march=native: load()
    must refuse before building anything (such a build keeps the kernels' 16-lane vectors in
    memory and ran linear_f32 100x slower), while this CPU's own target passes."""
    real = native._compiler()
    assert native._targets_avx512(real) == ("avx512f" in CPU_FLAGS)
    haswell = str(Path(__file__).parents[2] / "benchmarks" / "avx2_only" / "cc")
    monkeypatch.setenv("REAL_CC", shlex.join(real))
    assert not native._targets_avx512([haswell])
    cache = tmp_path / "cache"
    monkeypatch.setenv("CC", haswell)
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    assert native.load.__wrapped__() is None  # load() itself stays cached for other tests
    assert not cache.exists() or not any(cache.iterdir())
    monkeypatch.setenv("CC", shlex.join(real))
    if "avx512f" in CPU_FLAGS:
        assert native.load.__wrapped__() is not None
        assert any(cache.glob("native-*.so"))
