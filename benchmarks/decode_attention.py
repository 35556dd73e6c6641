"""Decode attention on CPU: how fast the native kernel reads the paged float32 KV cache.

For each (sequences, context length), a cache of 30 layers (SmolLM2-135M's heads: 9 query, 3
KV, 64 wide, 16-token blocks) with each sequence's blocks shuffled through it, as a serving
cache holds them; every layer's attention is run once per pass, so the keys and values stream
from memory, not from the caches. Prints JSON with milliseconds per pass (best of
`--repeats`), the GB/s of keys and values read, and the GB/s of a plain streaming read of
1 GiB: the machine's rate. `--huge-pages` allocates the cache as the engine does (an
anonymous mapping with transparent huge pages asked for); without it, from torch's allocator.

    python benchmarks/decode_attention.py [--shapes 32x340 6x380 64x64] [--huge-pages]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from pdserve.kernels import cpu_decode
from pdserve.kv_transfer.transport import zeroed_kv_cache

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def cache(num_blocks: int, huge_pages: bool) -> torch.Tensor:
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return zeroed_kv_cache(shape, torch.float32).normal_() if huge_pages else torch.randn(shape)


def time_pass(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(batch: int, context: int, repeats: int, huge_pages: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq
    layers = [(cache(num_blocks, huge_pages), cache(num_blocks, huge_pages))
              for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.long)
    rows = torch.arange(batch)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(q)

    def attention_pass():
        for k_cache, v_cache in layers:
            cpu_decode.decode_into(out, q, k_cache, v_cache, tables, lens, rows, HEAD_DIM ** -0.5)

    seconds = time_pass(attention_pass, repeats)
    read = batch * context * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # bytes of keys and values
    return {"sequences": batch, "context": context, "ms": round(1000 * seconds, 2),
            "gb_per_s": round(read / seconds / 1e9, 1)}


def stream_rate(repeats: int) -> float:
    """GB/s of a plain sum over 1 GiB (far beyond the caches), on the same threads."""
    flat = torch.ones(1 << 28)
    return round(flat.numel() * 4 / time_pass(flat.sum, repeats) / 1e9, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["32x340", "6x380", "64x64", "1x380"],
                    help="SEQUENCESxCONTEXT")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--huge-pages", action="store_true")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    results = [measure(*map(int, s.split("x")), args.repeats, args.huge_pages)
               for s in args.shapes]
    print(json.dumps({"machine": platform.processor() or platform.machine(),
                      "threads": torch.get_num_threads(), "huge_pages": args.huge_pages,
                      "load_before": load_before, "stream_gb_per_s": stream_rate(args.repeats),
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
