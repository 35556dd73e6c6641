"""KV transfer throughput per backend, producer process -> consumer process, beside memcpy.

    python benchmarks/kv_transfer.py [--backends shm,tcp,nixl] [--tokens 1000,8000]
                                     [--patterns contiguous,scattered] [--iters 15] [--out FILE]

Layout: SmolLM2-135M (30 layers, 3 KV heads, head dim 64, block size 16, float32; 720 KiB per
block). For a prompt of T tokens the consumer reads ceil(T/16) blocks from a producer process.
`contiguous`: remote blocks 0..n-1 into local 0..n-1 (a fresh engine's allocation);
`scattered`: random distinct remote and local ids (no two consecutive, worst case).
Each iteration times one `read_blocks` and one torch copy of a same-size contiguous tensor,
interleaved so both see the same machine load; medians are reported. One JSON line per
(backend, tokens, pattern): gbps, memcpy_gbps, ratio (= gbps / memcpy_gbps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pdserve.kv_transfer import KVLayout, make_transport, nixl_available

SMOLLM2 = {"num_layers": 30, "block_size": 16, "num_kv_heads": 3, "head_dim": 64, "dtype": "float32"}
TARGETS = {"shm": 0.7, "nixl": 0.5, "tcp": 0.25}
PREFIX = "DESCRIPTOR "


def fill(cache: torch.Tensor) -> None:
    """Cheap deterministic contents: element i holds i mod 65521."""
    flat = cache.view(-1)  # (numel,)
    step = 1 << 24
    for start in range(0, flat.numel(), step):
        n = min(step, flat.numel() - start)
        flat[start:start + n] = (torch.arange(start, start + n, dtype=torch.int64) % 65521).to(flat.dtype)


def serve(kind: str, num_blocks: int) -> None:
    """Producer process: allocate, fill, serve, print the descriptor, run until stdin closes."""
    transport = make_transport(kind, f"bench-prefill-{kind}")
    fill(transport.allocate_kv_cache(KVLayout(num_blocks=num_blocks, **SMOLLM2)))
    descriptor = transport.serve()
    lease = ["bench", transport.grant("bench", range(num_blocks))]  # reads need a live lease
    print(PREFIX + json.dumps({**descriptor, "bench_lease": lease}), flush=True)
    sys.stdin.read()
    transport.close()


def start_producer(kind: str, num_blocks: int) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", kind,
                             "--num-blocks", str(num_blocks)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # library logs may precede the descriptor
        if line.startswith(PREFIX):
            return proc, json.loads(line[len(PREFIX):])
    raise RuntimeError(f"{kind} producer exited with rc={proc.wait()}")


def block_ids(n: int, num_blocks: int, pattern: str, rng: random.Random) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        return list(range(n)), list(range(n))
    evens = list(range(0, num_blocks, 2))  # every other block: no runs to coalesce
    return rng.sample(evens, n), rng.sample(evens, n)


def measure(kind: str, desc: dict, dec, tokens: int, pattern: str, iters: int) -> dict:
    layout = KVLayout.from_dict(desc["layout"])
    n = math.ceil(tokens / layout.block_size)
    remote, local = block_ids(n, layout.num_blocks, pattern, random.Random(tokens))
    nbytes = n * layout.block_bytes
    src = torch.rand(nbytes // 4)  # memcpy baseline: same bytes, contiguous float32
    dst = torch.zeros_like(src)
    dec.kv_cache.zero_()
    t0 = time.perf_counter()
    moved = dec.read_blocks(desc, remote, local, tuple(desc["bench_lease"]))
    first_ms = (time.perf_counter() - t0) * 1e3
    assert moved == nbytes, (moved, nbytes)
    expected = torch.zeros(dec.kv_cache.shape, dtype=dec.kv_cache.dtype)
    fill(expected)  # the producer's contents, recomputed
    assert torch.equal(dec.kv_cache[:, :, local], expected[:, :, remote]), "data mismatch"
    del expected
    xfer, copy = [], []
    for _ in range(iters + 2):  # two warm-ups, then interleaved samples
        t0 = time.perf_counter()
        dec.read_blocks(desc, remote, local, tuple(desc["bench_lease"]))
        t1 = time.perf_counter()
        dst.copy_(src)
        t2 = time.perf_counter()
        xfer.append(t1 - t0)
        copy.append(t2 - t1)
    gbps = nbytes / statistics.median(xfer[2:]) / 1e9
    memcpy_gbps = nbytes / statistics.median(copy[2:]) / 1e9
    return {"backend": kind, "tokens": tokens, "pattern": pattern, "blocks": n, "bytes": nbytes,
            "gbps": round(gbps, 3), "memcpy_gbps": round(memcpy_gbps, 3),
            "ratio": round(gbps / memcpy_gbps, 3), "target_ratio": TARGETS[kind],
            "first_call_ms": round(first_ms, 2), "iters": iters,
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="shm,tcp,nixl")
    ap.add_argument("--tokens", default="1000,8000")
    ap.add_argument("--patterns", default="contiguous")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", help="also write all results as a JSON list to this file")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.num_blocks)

    load_before = os.getloadavg()[0]
    tokens = [int(t) for t in args.tokens.split(",")]
    num_blocks = 2 * math.ceil(max(tokens) / SMOLLM2["block_size"]) + 8  # room for "scattered"
    results = []
    for kind in args.backends.split(","):
        if kind == "nixl" and not nixl_available():
            print(json.dumps({"backend": kind, "skipped": "nixl not importable"}), flush=True)
            continue
        proc, desc = start_producer(kind, num_blocks)
        try:
            with make_transport(kind, f"bench-decode-{kind}") as dec:
                dec.allocate_kv_cache(KVLayout(num_blocks=num_blocks, **SMOLLM2))
                for t in tokens:
                    for pattern in args.patterns.split(","):
                        row = measure(kind, desc, dec, t, pattern, args.iters)
                        print(json.dumps(row), flush=True)
                        results.append(row)
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "cpus": os.cpu_count(),
                       "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                       "torch": torch.__version__, "results": results}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
