"""Paged attention on a GPU: the Triton kernels against the torch reference, same inputs.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16) with
scattered block tables. Decode batches of B sequences with context lengths drawn uniformly
from [L/2, L]; prefill steps of whole prompts. Each case is timed with
`triton.testing.do_bench` (CUDA events, median of repeats, one layer's attention). The
reference is `pdserve.kernels.attention.paged_attention` (what CPU tensors use), run on the
GPU. For decode, GB/s counts the K and V bytes the step must read once.

    python benchmarks/kernels_gpu.py [--dtype bfloat16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from pdserve.kernels import attention as ref
from pdserve.kernels import triton_attention as ta
from pdserve.kernels.attention import AttentionMetadata, PrefillSpan
from report import emit

H, KVH, D, BLOCK = 9, 3, 64, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_step(decode_lens: list[int], prompt_lens: list[int], dtype: torch.dtype, seed: int):
    """q, k, v, caches and metadata of one step on the GPU; blocks drawn at random from a pool
    twice the size needed."""
    gen = torch.Generator().manual_seed(seed)
    lens = decode_lens + prompt_lens
    needed = [-(-n // BLOCK) for n in lens]
    num_blocks = 2 * sum(needed) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for nb in needed:
        tables.append(perm[used:used + nb])
        used += nb
    dev = "cuda"
    shape = (num_blocks, BLOCK, KVH, D)
    k_cache = torch.randn(shape, device=dev).to(dtype)
    v_cache = torch.randn(shape, device=dev).to(dtype)
    num_new = [1] * len(decode_lens) + prompt_lens
    slots = []
    for table, n, new in zip(tables, lens, num_new):
        pos = torch.arange(n - new, n)
        slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
    T = sum(num_new)
    q = torch.randn(T, H, D, device=dev).to(dtype)
    k = torch.randn(T, KVH, D, device=dev).to(dtype)
    v = torch.randn(T, KVH, D, device=dev).to(dtype)
    width = max(needed[:len(decode_lens)], default=0)
    dec_tables = torch.zeros(len(decode_lens), width, dtype=torch.int64)
    for i in range(len(decode_lens)):
        dec_tables[i, :needed[i]] = tables[i]
    spans, tok = [], len(decode_lens)
    for j, n in enumerate(prompt_lens):
        spans.append(PrefillSpan(tok, tok + n, n, tables[len(decode_lens) + j].to(dev)))
        tok += n
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(dev),
        decode_token_idx=torch.arange(len(decode_lens), device=dev),
        decode_block_tables=dec_tables.to(dev),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int64, device=dev),
        prefills=spans)
    return q, k, v, k_cache, v_cache, meta


def time_case(name: str, decode_lens: list[int], prompt_lens: list[int],
              dtype: torch.dtype) -> dict:
    q, k, v, kc, vc, meta = make_step(decode_lens, prompt_lens, dtype, seed=len(name))
    scale = D ** -0.5

    def run_triton():
        ta.paged_attention(q, k, v, kc, vc, meta, scale)

    def run_reference():
        meta._decode_plan = None  # the reference plans once per step, as the engine does
        ref.paged_attention(q, k, v, kc, vc, meta, scale)

    out_t = ta.paged_attention(q, k, v, kc, vc, meta, scale).double()
    meta._decode_plan = None
    out_r = ref.paged_attention(q, k, v, kc, vc, meta, scale).double()
    err = float((out_t - out_r).norm() / out_r.norm())
    t_ms = triton.testing.do_bench(run_triton, warmup=50, rep=300, return_mode="median")
    r_ms = triton.testing.do_bench(run_reference, warmup=50, rep=300, return_mode="median")
    kv_bytes = sum(decode_lens) * KVH * D * 2 * kc.element_size()
    row = {"case": name, "decodes": len(decode_lens),
           "decode_context_tokens": sum(decode_lens), "prefill_tokens": sum(prompt_lens),
           "triton_us": round(t_ms * 1e3, 1), "reference_us": round(r_ms * 1e3, 1),
           "speedup": round(r_ms / t_ms, 2), "rel_err_vs_reference": f"{err:.1e}"}
    if decode_lens and not prompt_lens:
        row["decode_kv_GBps"] = round(kv_bytes / (t_ms * 1e-3) / 1e9, 1)
    return row


def cases() -> list[tuple[str, list[int], list[int]]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for ctx in (512, 2048):
        for b in (1, 8, 32, 64, 128, 256):
            lens = torch.randint(ctx // 2, ctx + 1, (b,), generator=gen).tolist()
            out.append((f"decode B={b} ctx<={ctx}", lens, []))
    out.append(("prefill 1x2048", [], [2048]))
    out.append(("prefill 8x256", [], [256] * 8))
    mixed = torch.randint(256, 1025, (32,), generator=gen).tolist()
    out.append(("mixed 32 decodes + 512 prefill", mixed, [512]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_gpu.py needs a CUDA device")
    dtype = DTYPES[args.dtype]
    rows = []
    for name, dec, pre in cases():
        rows.append(time_case(name, dec, pre, dtype))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"command": "python " + " ".join(["benchmarks/kernels_gpu.py"] + sys.argv[1:]),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "dtype": args.dtype, "rows": rows}
    emit(result, args.out)


if __name__ == "__main__":
    main()
