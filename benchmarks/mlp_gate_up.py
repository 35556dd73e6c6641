"""An MLP's gate/up projection and SiLU-and-mul on the native float32 panels: the two kernels
(`linear_f32`, then `silu_mul_f32` over the (rows, 2n) projection) against the one pass
(`linear_silu_mul_f32`), which stores only silu(gate) * up. SmolLM2-135M's shape by default
(n = 1536 outputs of each, k = 576 inputs), random weights, 2 threads; the three variants
(plus the projection alone) alternate in every round, and the medians are printed as JSON,
with a check that both ways give the same values bit for bit.

    python benchmarks/mlp_gate_up.py [--rows 64 512 2048] [--rounds 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from pdserve.kernels import native
from pdserve.kernels.cpu_linear import pack_panels
from report import emit


def variants(lib, x: torch.Tensor, panels: torch.Tensor, n: int, k: int, threads: int) -> dict:
    rows = x.shape[0]
    gate_up, two, one = torch.empty(rows, 2 * n), torch.empty(rows, n), torch.empty(rows, n)

    def projection():
        lib.linear_f32(x.data_ptr(), k, rows, panels.data_ptr(), 2 * n, k, None,
                       gate_up.data_ptr(), 2 * n, threads)

    def two_kernels():
        projection()
        lib.silu_mul_f32(gate_up.data_ptr(), 2 * n, two.data_ptr(), n, rows, n, threads)

    def one_pass():
        if lib.linear_silu_mul_f32(x.data_ptr(), k, rows, panels.data_ptr(), n, k,
                                   one.data_ptr(), n, threads):
            raise ValueError(f"n={n} is not a multiple of 32")

    two_kernels()
    one_pass()
    if not torch.equal(one, two):
        raise AssertionError("the one pass differs from the two kernels")
    return {"two_kernels": two_kernels, "one_pass": one_pass, "projection_alone": projection}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 512, 2048])
    p.add_argument("--n", type=int, default=1536, help="outputs of gate (and of up)")
    p.add_argument("--k", type=int, default=576, help="inputs")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    lib = native.load()
    if lib is None:
        raise SystemExit("native kernels not built")
    g = torch.Generator().manual_seed(0)
    panels = pack_panels(torch.randn(2 * args.n, args.k, generator=g) / args.k ** 0.5)
    results = []
    for rows in args.rows:
        fns = variants(lib, torch.randn(rows, args.k, generator=g), panels, args.n, args.k,
                       args.threads)
        reps = max(3, 6000 // rows)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[name].append((time.perf_counter() - t0) / reps * 1e3)
        ms = {name: round(statistics.median(v), 3) for name, v in times.items()}
        results.append({"rows": rows, "ms_median": ms,
                        "two_kernels_over_one_pass": round(ms["two_kernels"] / ms["one_pass"], 3)})
    emit({"command": " ".join(["python benchmarks/mlp_gate_up.py"] + sys.argv[1:]),
          "n": args.n, "k": args.k, "threads": args.threads, "cpu": platform.processor(),
          "loadavg_1m": os.getloadavg()[0], "results": results}, args.out)


if __name__ == "__main__":
    main()
