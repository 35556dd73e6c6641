"""Native CPU kernels: the C sources in kernels/csrc, compiled once per machine and cached.

The library is built with the system's C compiler (`$CC`, else `cc` / `gcc`) for the CPU it
runs on (`-march=native`), into `$PDSERVE_CACHE_DIR` (default `~/.cache/pdserve`) under a name
that hashes the sources, the flags, the compiler and the CPU, so a shared home directory never
hands one machine another's build. An engine loads it when its model is built (`load()`), so
the first build (under a second) never lands on a request. Without a compiler, on a target
without the vectors below, or with `PDSERVE_NATIVE_KERNELS=0`, `load()` returns None and the
torch kernels serve instead.

The kernels are written on vectors of the target's register width (csrc/vec.h): 16 float32
lanes for AVX-512, 8 for AVX2 (with FMA and F16C, as every AVX2 CPU has), 4 for other x86-64
CPUs (SSE2) and for Arm (NEON). A vector wider than the registers would be kept in memory
(GCC 12 ran a 16-lane linear_f32 built for AVX2 at 3 GFLOP/s, where the 8-lane build runs
near the AVX2 peak: benchmarks/results/linear_cpu.md, "AVX2 builds" and "Kernels on 8
lanes"), so the width is asked of the compiler first.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.cache_dir import cache_dir

log = logging.getLogger(__name__)

SOURCES = ("paged_decode.c", "paged_prefill.c", "elementwise.c", "argmax.c", "linear.c",
           "linear_coded.c", "decoder_layers.c", "decoder_lanes.c", "vector_lanes.c")
HEADERS = ("vec.h", "kernels.h", "decoder_layers.h", "panel.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno",
         "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math", "-shared", "-fPIC")
DISABLE_ENV = "PDSERVE_NATIVE_KERNELS"
_CSRC = Path(__file__).resolve().parent / "csrc"

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    # q, q_stride, k_cache, v_cache, num_blocks, block_size, kvh, d, tables, max_blocks,
    # lens, rows, B, h, scale, out, num_threads
    "paged_decode_f32": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr,
                         _ptr, _i64, _i64, ctypes.c_float, _ptr, ctypes.c_int],
    # q, q_stride, k_cache, v_cache, num_blocks, block_size, kvh, d, table, table_len, n, L,
    # h, scale, out, out_stride, num_threads
    "paged_prefill_f32": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i64,
                          _i64, _i64, ctypes.c_float, _ptr, _i64, ctypes.c_int],
    # x, x_stride, w, out, out_stride, rows, n, eps, num_threads
    "rms_norm_f32": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int],
    # x, x_stride, delta, delta_stride, w, out, out_stride, rows, n, eps, num_threads
    "add_rms_norm_f32": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_float,
                         ctypes.c_int],
    # x, x_stride, rows, n, out (int64), num_threads
    "argmax_rows_f32": [_ptr, _i64, _i64, _i64, _ptr, ctypes.c_int],
    # gate_up, gate_up_stride, out, out_stride, rows, n, num_threads
    "silu_mul_f32": [_ptr, _i64, _ptr, _i64, _i64, _i64, ctypes.c_int],
    # x, x_stride, rows, panels, n, k, bias (or NULL), out, out_stride, num_threads
    "linear_f32": [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, ctypes.c_int],
    # x, x_stride, rows, panels (of 2n outputs), n, k, out, out_stride, num_threads
    "linear_silu_mul_f32": [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, ctypes.c_int],
    # x, x_stride, rows, codes, params, code_bits, n, k, bias (or NULL), out, out_stride,
    # num_threads
    "linear_coded_f32": [_ptr, _i64, _i64, _ptr, _ptr, ctypes.c_int, _i64, _i64, _ptr, _ptr,
                         _i64, ctypes.c_int],
    "vector_lanes": [],
    # v, runs, guess_scales, guess_offsets, num_guesses, codes, scales, offsets, num_threads
    "code_runs_f32": [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, ctypes.c_int],
    # x, row_stride, rows, heads, head_dim, cos, sin, num_threads
    "rotary_f32": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, ctypes.c_int],
    # x, T, shape, layers, kv, num_blocks, block_size, cos, sin, batch, num_threads
    "decoder_layers_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr,
                           ctypes.c_int],
    # x, T, shape, layers, kv, num_blocks, block_size, cos, sin, batch, bounds, num_lanes
    "decoder_lanes_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr,
                          _i64],
}
_RESULT = {"code_runs_f32": _i64}
_VOID = {"rms_norm_f32", "add_rms_norm_f32", "argmax_rows_f32", "silu_mul_f32", "rotary_f32",
         "linear_f32", "linear_coded_f32"}


def _compiler() -> list[str] | None:
    """The C compiler's command words (`$CC` may carry several: "ccache gcc")."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return shlex.split(cc) if cc else None


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "|".join(dict.fromkeys(line for line in lines if line.startswith(wanted)))


def vector_lanes(cc: list[str]) -> int | None:
    """The float32 lanes of the vectors `cc -march=native` compiles for (its predefined macros
    say): 16 for AVX-512, 8 for AVX2 with FMA and F16C, 4 for other x86-64 targets (SSE2) and
    Arm's NEON, else None (also, with a warning, when the compiler cannot be asked)."""
    try:
        done = subprocess.run([*cc, "-march=native", "-dM", "-E", "-x", "c", os.devnull],
                              capture_output=True, text=True, errors="replace", timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not ask %s for its target: %s", shlex.join(cc), e)
        return None
    if done.returncode != 0:
        log.warning("%s -march=native -dM -E failed: %s", shlex.join(cc), done.stderr[-500:])
        return None
    macros = set(done.stdout.splitlines())
    if "#define __AVX512F__ 1" in macros:
        return 16
    if {"#define __AVX2__ 1", "#define __FMA__ 1", "#define __F16C__ 1"} <= macros:
        return 8
    if macros & {"#define __SSE2__ 1", "#define __ARM_NEON 1"}:
        return 4
    return None


def _build_key(cc: list[str], lanes: int) -> str:
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True,
                             errors="replace", timeout=30).stdout
    parts = [(_CSRC / s).read_bytes() for s in SOURCES + HEADERS]
    parts += [" ".join(FLAGS).encode(), shlex.join(cc).encode(), version.encode(),
              platform.machine().encode(), _cpu_identity().encode(), bytes([lanes])]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def _build(cc: list[str], target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename (concurrent builders race
    harmlessly)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [*cc, *FLAGS, *(str(_CSRC / s) for s in SOURCES), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The native kernel library, built on first use; None when disabled or not buildable."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found: the torch CPU kernels serve")
        return None
    lanes = vector_lanes(cc)
    if lanes is None:
        log.info("%s -march=native targets none of the vectors the native kernels need "
                 "(AVX-512, AVX2, SSE2, NEON): the torch CPU kernels serve", shlex.join(cc))
        return None
    importlib.import_module("torch")  # its libgomp first: the library then shares its threads

    cache = cache_dir()
    try:
        target = cache / f"native-{_build_key(cc, lanes)}.so"
        if not target.exists():
            _build(cc, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native CPU kernels unavailable, the torch kernels serve: %s", e)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None if name in _VOID else _RESULT.get(name, ctypes.c_int)
    if lib.vector_lanes() != lanes:
        log.warning("native CPU kernels built for %d lanes where %d were asked for: the torch "
                    "kernels serve", lib.vector_lanes(), lanes)
        return None
    log.debug("native CPU kernels on %d float32 lanes", lanes)
    return lib
