"""The native kernels built for 64-bit Arm (NEON: 4 float32 lanes, 32 vector registers) and run
under an emulator. The engine asks the compiler for its target's lanes, so an Arm compiler must
answer 4; the Arm build's linear kernels (float32 panels, silu-and-mul, every coded form) must
give this machine's results bit for bit, since NEON multiplies and adds in one rounding like
AVX2 and AVX-512, and each output is one multiply-add chain whatever the width; and its decode
and prefill attention (tiles no x86 build has: 4 lanes with 32 registers) must agree with this
machine's within float32 rounding (their sums run across lanes, in another order).

Needs a cross compiler and an emulator (Debian: `apt-get install gcc-aarch64-linux-gnu
qemu-user`); skipped, saying so, without them.
"""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_native_targets import (
    OUTPUTS,
    ROWS,
    SILU_ROWS,
    linear_inputs,
    linear_outputs,
    wrapper_for,
)

from pdserve.kernels import native
from pdserve.kernels.coded_weights import encode
from pdserve.kernels.cpu_decode import decode_into
from pdserve.kernels.cpu_linear import pack_panels
from pdserve.kernels.cpu_prefill import prefill_into

CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
DRIVER = Path(__file__).with_name("native_driver.c")

pytestmark = pytest.mark.skipif(not (CROSS and QEMU),
                                reason="needs aarch64-linux-gnu-gcc and qemu-aarch64")


def test_an_arm_compiler_targets_4_lanes(tmp_path, monkeypatch):
    monkeypatch.setenv("REAL_CC", CROSS)
    assert native.vector_lanes([wrapper_for(["-march=armv8-a"], tmp_path)]) == 4


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    """native_driver.c and the kernels, built for Arm with the engine's own flags."""
    out = tmp_path_factory.mktemp("arm") / "native_driver"
    flags = [f for f in native.FLAGS if f not in ("-march=native", "-shared", "-fPIC")]
    sources = [str(native._CSRC / s) for s in native.SOURCES]
    done = subprocess.run([CROSS, *flags, "-march=armv8-a", "-static", *sources, str(DRIVER),
                           "-lm", "-o", str(out)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def run(driver: Path, *args) -> str:
    done = subprocess.run([QEMU, str(driver), *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def saved(tensor: torch.Tensor | None, path: Path) -> str:
    if tensor is None:
        return "-"
    tensor.contiguous().numpy().tofile(path)
    return str(path)


def loaded(path: Path, rows: int, n: int) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.float32)).view(rows, n)


@pytest.mark.skipif(native.load() is None, reason="no build on this machine to compare with")
def test_the_arm_build_gives_this_machines_linear_results(driver, tmp_path):
    assert run(driver, "lanes").split() == ["4"]
    ours = linear_outputs()
    fma = native.load().vector_lanes() >= 8  # this machine's build rounds once a step too
    x, weights, bias = linear_inputs()
    k = x.shape[1]
    xs, bs, out = saved(x, tmp_path / "x"), saved(bias, tmp_path / "bias"), tmp_path / "out"
    theirs = {}
    for name, w in weights.items():
        coded = None if name == "f32" else encode(w)
        panels = saved(pack_panels(w), tmp_path / "panels")
        if coded is not None:
            codes = saved(coded.codes, tmp_path / "codes")
            params = saved(coded.params, tmp_path / "params")
        for n in OUTPUTS:
            for rows in ROWS:
                b = bs if rows % 2 else "-"
                if coded is None:
                    run(driver, "f32", rows, n, k, xs, panels, b, out)
                else:
                    run(driver, "coded", coded.bits, rows, n, k, xs, codes, params, b, out)
                theirs[f"{name}-{n}-{rows}"] = loaded(out, rows, n)
    gate_up = saved(pack_panels(weights["f32"][:64]), tmp_path / "gate_up")
    for rows in SILU_ROWS:
        run(driver, "silu", rows, 32, k, xs, gate_up, out)
        theirs[f"silu-{rows}"] = loaded(out, rows, 32)
    assert theirs.keys() == ours.keys()
    for key, mine in ours.items():
        if fma:
            assert torch.equal(theirs[key].view(torch.int32), mine.view(torch.int32)), key
        else:
            torch.testing.assert_close(theirs[key], mine, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.skipif(native.load() is None, reason="no build on this machine to compare with")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_the_arm_build_gives_this_machines_attention(driver, tmp_path, heads, kv_heads,
                                                     head_dim):
    g = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, scale = 48, 16, head_dim ** -0.5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    kc, vc = saved(k_cache, tmp_path / "kc"), saved(v_cache, tmp_path / "vc")
    order = torch.randperm(num_blocks, generator=g)  # blocks scattered over the cache
    lens = torch.tensor([1, 17, 40, 100, 333])
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:21] for _ in range(5)])
    q = torch.randn(5, heads, head_dim, generator=g)
    ours = torch.empty_like(q)
    decode_into(ours, q, k_cache, v_cache, tables, lens, torch.arange(5), scale)
    out = tmp_path / "out"
    run(driver, "decode", num_blocks, block_size, kv_heads, head_dim, heads, 5, 21, scale,
        saved(q, tmp_path / "q"), kc, vc, saved(tables, tmp_path / "tables"),
        saved(lens, tmp_path / "lens"), out)
    theirs = loaded(out, 5, heads * head_dim).view_as(q)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    for new, context in ((1, 1), (70, 150), (200, 333)):  # prompt chunks, the last one whole
        q = torch.randn(new, heads, head_dim, generator=g)
        ours = torch.empty_like(q)
        prefill_into(ours, q, k_cache, v_cache, order[:21], context, scale)
        run(driver, "prefill", num_blocks, block_size, kv_heads, head_dim, heads, new,
            context, 21, scale, saved(q, tmp_path / "q"), kc, vc,
            saved(order[:21], tmp_path / "table"), out)
        theirs = loaded(out, new, heads * head_dim).view_as(q)
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6, msg=f"{new} of {context}")
