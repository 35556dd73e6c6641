"""CPU linear layers: F.linear, oneDNN's packed layout, the native kernel's float32 panels and
its coded weights (pdserve.kernels.cpu_linear, coded_weights).

Runs every projection of a model's decoder stack (random weights of SmolLM2-135M's shapes by
default: 30 layers of qkv, o, gate_up and down, plus the tied LM head, quantized to Q4_1 and
the head to Q8_0 and back to float32, as the bundled GGUF is) at several row counts,
alternating the implementations, and prints JSON with milliseconds per pass and the ratios
oneDNN / panels, F.linear / panels and panels / coded (above 1: the latter is faster).
`coded` is PackedLinear as the engine runs it: coded weights up to coded_max_rows() rows (the
Q4_1 projections two codes a byte), the panels above; `coded8` the same with a byte per code
and float32 scales and offsets (the form before the 4-bit one); `bf16` the same on those
weights rounded to bfloat16 (as a bf16 checkpoint computed in float32 is held).
With `--per-shape`, each of a layer's four projections alone instead, the same weight again
and again (it stays in the caches, as a long prompt's rows reuse it), panels against oneDNN
in GFLOP/s.

    python benchmarks/linear_cpu.py [--rows 1 8 64 2048] [--repeats 5] [--per-shape]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from pdserve.kernels.cpu_linear import PackedLinear
from pdserve.models.gguf_file import dequantize_ggml

SMOLLM2_135M = {"layers": 30, "hidden": 576, "qkv": 576 + 2 * 192, "inter": 1536,
                "vocab": 49152}


def gguf_values(w: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """w quantized by gguf and dequantized by the model loader: float32 again."""
    raw = quants.quantize(w.numpy(), qtype).reshape(-1).view(np.uint8)
    return dequantize_ggml(torch.from_numpy(raw.copy()), qtype, tuple(w.shape))


def weights(shape: dict) -> list[torch.Tensor]:
    """(out, in) weights of every projection, in model order."""
    h, per_layer, q4 = shape["hidden"], [], GGMLQuantizationType.Q4_1
    for _ in range(shape["layers"]):
        per_layer += [gguf_values(torch.randn(*s) * 0.05, q4) for s in (
            (shape["qkv"], h), (h, h), (2 * shape["inter"], h), (h, shape["inter"]))]
    head = gguf_values(torch.randn(shape["vocab"], h) * 0.05, GGMLQuantizationType.Q8_0)
    return per_layer + [head]


def float32_panels(w: torch.Tensor) -> PackedLinear:
    layer = PackedLinear(w, layout="panels")
    layer.codes = layer.code_params = None
    return layer


def byte_codes(w: torch.Tensor) -> PackedLinear:
    """PackedLinear with its 4-bit codes (if any) held a byte each, float32 params."""
    layer = PackedLinear(w, layout="panels")
    if layer.code_bits == 4:
        c = layer.codes
        layer.codes = torch.cat([c & 15, c >> 4], dim=2).to(torch.int8)
        layer.code_params, layer.code_bits = layer.code_params.float(), 8
    return layer


def time_pass(fns: list, inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for in_features, fn in fns:
        fn(inputs[in_features])
    return time.perf_counter() - start


def per_shape(ws: list[torch.Tensor], rows: int, repeats: int) -> list[dict]:
    """GFLOP/s of the panels and of oneDNN on each of layer 0's projections, alternating,
    median of `repeats` timings of five calls each."""
    out = []
    with torch.inference_mode():
        for w in ws[:4]:
            x, flop = torch.randn(rows, w.shape[1]), 2 * rows * w.shape[0] * w.shape[1]
            impls = {"panels": float32_panels(w), "onednn": PackedLinear(w, layout="onednn")}
            rates = {name: [] for name in impls}
            for _ in range(repeats + 1):  # the first round warms up, not counted
                for name, layer in impls.items():
                    start = time.perf_counter()
                    for _ in range(5):
                        layer(x)
                    rates[name].append(5 * flop / (time.perf_counter() - start) / 1e9)
            gflops = {k: statistics.median(v[1:]) for k, v in rates.items()}
            out.append({"rows": rows, "out": w.shape[0], "in": w.shape[1],
                        **{f"{k}_gflops": round(v, 1) for k, v in gflops.items()},
                        "panels_over_onednn": round(gflops["panels"] / gflops["onednn"], 3)})
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+",
                   default=[1, 4, 8, 16, 24, 32, 64, 128, 512, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--per-shape", action="store_true",
                   help="each projection alone, its weight warm in the caches")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    ws = weights(SMOLLM2_135M)
    if args.per_shape:
        results = [r for rows in args.rows for r in per_shape(ws, rows, args.repeats)]
        print(json.dumps({"command": " ".join(["python benchmarks/linear_cpu.py", *(
            sys.argv[1:] if argv is None else argv)]), "threads": torch.get_num_threads(),
            "load_after": os.getloadavg()[0], "results": results}, indent=1))
        return 0
    impls = {"f_linear": [(w.shape[1], lambda x, w=w: F.linear(x, w)) for w in ws],
             "onednn": [(w.shape[1], PackedLinear(w, layout="onednn")) for w in ws],
             "panels": [(w.shape[1], float32_panels(w)) for w in ws],
             "coded": [(w.shape[1], PackedLinear(w, layout="panels")) for w in ws],
             "coded8": [(w.shape[1], byte_codes(w)) for w in ws],
             "bf16": [(w.shape[1], PackedLinear(w.bfloat16().float(), layout="panels"))
                      for w in ws]}
    assert all(layer.codes is not None for _, layer in impls["coded"] + impls["bf16"])
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {n: torch.randn(rows, n) for n in {w.shape[1] for w in ws}}
            times = {name: [] for name in impls}
            for _ in range(args.repeats + 1):  # the first round warms up, not counted
                for name, fns in impls.items():
                    times[name].append(time_pass(fns, inputs))
            ms = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
            results.append({"rows": rows, **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
                            "onednn_over_panels": round(ms["onednn"] / ms["panels"], 3),
                            "f_linear_over_panels": round(ms["f_linear"] / ms["panels"], 3),
                            "panels_over_coded": round(ms["panels"] / ms["coded"], 3),
                            "coded8_over_coded": round(ms["coded8"] / ms["coded"], 3),
                            "panels_over_bf16": round(ms["panels"] / ms["bf16"], 3)})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"command": " ".join(["python benchmarks/linear_cpu.py", *(
        sys.argv[1:] if argv is None else argv)]), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "load_after": os.getloadavg()[0],
        "machine": platform.processor() or platform.machine(),
        "shapes": SMOLLM2_135M, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
