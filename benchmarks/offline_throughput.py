"""Offline throughput: pdserve's `LLM.generate` against transformers' batched `generate`.

Both run the same workload, in one process, on the same weights (the bundled SmolLM2-135M
unless `--model`), on the same device (`--device`: the GPU when there is one) and in the same
type (`--dtype`, float32 unless given) with greedy decoding:

- mixed workload: `--num-requests` prompts with lengths spread uniformly over
  [`--min-prompt`, `--max-prompt`] tokens and output lengths over [`--min-output`,
  `--max-output`] (`ignore_eos`: every request generates exactly its length). Prompts are
  windows of a fixed synthetic English-like text corpus, tokenized once (real text tokens, no
  shared prefixes between prompts). pdserve gets every request at once; transformers gets
  padded batches (left padding, in request order) of each size in `--hf-batch-sizes` and its
  best is reported. A transformers batch must generate up to the longest output of the batch
  (`min_new_tokens = max_new_tokens`); only the requested tokens count as useful output.
  Throughput = useful generated tokens / wall time.
- shared prefix: time to first token (add_request, then `step()` until the first output token
  arrives) of a prompt = `--prefix-len`-token prefix + a fresh `--suffix-len`-token suffix,
  cold (a new, never-seen prefix each time) and hot (the prefix cached by an earlier request),
  `--ttft-reps` times each, interleaved; medians.

Prints one JSON document; `--out FILE` also writes it there. `--quick` is a small smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pdserve import LLM, SamplingParams, TokensPrompt  # noqa: E402
from text_workload import text_workload  # noqa: E402

# --------------------------------------------------------------------------- pdserve

def run_pdserve(llm: LLM, reqs) -> dict:
    # Start from an empty prefix cache: a repeated run must not hit the blocks of the last one.
    if not llm.llm_engine.block_pool.reset_prefix_cache():
        raise RuntimeError("pdserve: blocks still in use, cannot reset the prefix cache")
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == [o for _, o in reqs], "pdserve did not generate the requested lengths"
    cached = sum(o.num_cached_tokens for o in outs)
    assert cached == 0, f"pdserve: {cached} prompt tokens hit the prefix cache"
    useful = sum(got)
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "useful_tokens": useful,
            "tokens_per_s": round(useful / wall, 2),
            "tokens_per_cpu_s": round(useful / cpu, 2),
            "prompt_tokens": sum(len(ids) for ids, _ in reqs)}


def ttft_once(engine, rid: str, ids: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first output carrying a token; cached tokens."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)
    first = None
    while first is None:
        for out in engine.step():
            if out.request_id == rid and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
                cached = out.num_cached_tokens
    while engine.has_unfinished_requests():  # max_tokens=1: already finished; be safe
        engine.step()
    return first, cached


def run_ttft(llm: LLM, corpus_rng: random.Random, vocab_ids: list[int], args) -> dict:
    engine = llm.llm_engine

    def rand(n: int) -> list[int]:
        return [corpus_rng.choice(vocab_ids) for _ in range(n)]

    hot_prefix = rand(args.prefix_len)
    ttft_once(engine, "ttft-warm", hot_prefix + rand(args.suffix_len))  # caches the prefix
    cold, hot, cold_cached, hot_cached = [], [], [], []
    for i in range(args.ttft_reps):
        t, c = ttft_once(engine, f"ttft-cold-{i}", rand(args.prefix_len) + rand(args.suffix_len))
        cold.append(t)
        cold_cached.append(c)
        t, c = ttft_once(engine, f"ttft-hot-{i}", hot_prefix + rand(args.suffix_len))
        hot.append(t)
        hot_cached.append(c)
    cold_med, hot_med = statistics.median(cold), statistics.median(hot)
    return {"prompt_tokens": args.prefix_len + args.suffix_len,
            "cold_ms": [round(t * 1e3, 2) for t in cold],
            "hot_ms": [round(t * 1e3, 2) for t in hot],
            "cold_median_ms": round(cold_med * 1e3, 2), "hot_median_ms": round(hot_med * 1e3, 2),
            "cold_cached_tokens": cold_cached, "hot_cached_tokens": hot_cached,
            "speedup": round(cold_med / hot_med, 2)}


# --------------------------------------------------------------------------- transformers

def build_hf_model(llm: LLM):
    """transformers' Llama holding the same weights pdserve loaded, on its device and in its
    dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.models.loader import load_state_dict

    model_config = llm.llm_engine.config.model
    resolved, dtype = model_config.resolved, model_config.dtype
    device = llm.llm_engine.config.device.device
    if not resolved.gguf_file:
        return AutoModelForCausalLM.from_pretrained(resolved.path, dtype=dtype,
                                                    local_files_only=True).eval().to(device)
    config = AutoConfig.from_pretrained(resolved.directory, gguf_file=resolved.gguf_file,
                                        local_files_only=True)
    config.tie_word_embeddings = model_config.arch.tie_word_embeddings
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(load_state_dict(resolved, dtype), strict=False)
    model.tie_weights()
    return model.eval().to(device)


@torch.inference_mode()
def run_hf(model, reqs, batch_size: int, pad_id: int, cache: str | None = None) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    generated = 0
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b:b + batch_size]
        width = max(len(ids) for ids, _ in batch)
        new = max(o for _, o in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, _) in enumerate(batch):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        kwargs = {"cache_implementation": cache} if cache else {}
        out = model.generate(input_ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=pad_id, **kwargs)
        assert out.shape[1] == width + new
        out.cpu()  # waits for the device
        generated += len(batch) * new
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    useful = sum(o for _, o in reqs)
    return {"batch_size": batch_size, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "useful_tokens": useful, "generated_tokens": generated,
            "tokens_per_s": round(useful / wall, 2), "tokens_per_cpu_s": round(useful / cpu, 2)}


# --------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--quick", action="store_true", help="small smoke version")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64")
    ap.add_argument("--hf-caches", default="dynamic,static",
                    help="transformers KV caches to try (cache_implementation)")
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--ttft-reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (both)")
    ap.add_argument("--skip-hf", action="store_true", help="pdserve only (profiling)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    ap.add_argument("--dtype", default="float32", help="both systems (float32, bfloat16, ...)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.max_prompt, args.max_output = 8, 128, 32
        args.hf_batch_sizes, args.ttft_reps, args.prefix_len = "4,8", 3, 512
        args.hf_caches = "dynamic"

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    engine_kwargs = {}
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs:
        engine_kwargs["max_num_seqs"] = args.max_num_seqs
    if args.kv_cache_memory_bytes:
        engine_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, **engine_kwargs)
    device = llm.llm_engine.config.device.device
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    sched = llm.llm_engine.config.scheduler

    corpus, reqs = text_workload(tok, args.seed, args.num_requests,
                                 (args.min_prompt, args.max_prompt),
                                 (args.min_output, args.max_output))
    vocab_ids = sorted(set(corpus))

    # Warm-up (allocator, lazy inits) on a few requests outside the timed runs.
    warm = [(corpus[:64], 8), (corpus[100:140], 4)]
    run_pdserve(llm, warm)

    result: dict = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "model": args.model,
        "config": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                   "cpu_count": os.cpu_count(), "python": platform.python_version(),
                   "device": device, "gpu": (torch.cuda.get_device_name()
                                             if device == "cuda" else None),
                   "dtype": args.dtype, "quick": args.quick, "seed": args.seed,
                   "pdserve_max_num_batched_tokens": sched.max_num_batched_tokens,
                   "pdserve_max_num_seqs": sched.max_num_seqs, "load_s": round(load_s, 2)},
        "workload": {"num_requests": len(reqs),
                     "prompt_len_range": [args.min_prompt, args.max_prompt],
                     "output_len_range": [args.min_output, args.max_output],
                     "prompt_tokens": sum(len(i) for i, _ in reqs),
                     "useful_output_tokens": sum(o for _, o in reqs)},
    }
    # pdserve runs before and after transformers (load on a shared machine drifts); the
    # better run counts, as the best transformers configuration does.
    pd_runs = [run_pdserve(llm, reqs)]
    print(f"pdserve: {pd_runs[0]['tokens_per_s']} tok/s ({pd_runs[0]['wall_s']} s, "
          f"cpu {pd_runs[0]['cpu_s']} s)", file=sys.stderr, flush=True)

    runs = []
    if not args.skip_hf:
        hf_model = build_hf_model(llm)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        run_hf(hf_model, warm, 2, pad)
        for cache in args.hf_caches.split(","):
            for bs in [int(x) for x in args.hf_batch_sizes.split(",")]:
                r = {"cache": cache, **run_hf(hf_model, reqs, bs, pad,
                                              None if cache == "dynamic" else cache)}
                print(f"transformers {cache} bs={bs}: {r['tokens_per_s']} tok/s "
                      f"({r['wall_s']} s, cpu {r['cpu_s']} s)", file=sys.stderr, flush=True)
                runs.append(r)
        del hf_model
        pd_runs.append(run_pdserve(llm, reqs))
        print(f"pdserve: {pd_runs[1]['tokens_per_s']} tok/s ({pd_runs[1]['wall_s']} s, "
              f"cpu {pd_runs[1]['cpu_s']} s)", file=sys.stderr, flush=True)

    pd = max(pd_runs, key=lambda r: r["tokens_per_s"])
    result["pdserve"] = {"runs": pd_runs, "best": pd}
    if runs:
        best = max(runs, key=lambda r: r["tokens_per_s"])
        result["transformers"] = {"runs": runs, "best": best}
        result["throughput_ratio"] = round(pd["tokens_per_s"] / best["tokens_per_s"], 2)
        # Same comparison in process CPU time: less sensitive to other load on the machine.
        best_cpu = max(r["tokens_per_cpu_s"] for r in runs)
        pd_cpu = max(r["tokens_per_cpu_s"] for r in pd_runs)
        result["throughput_ratio_cpu"] = round(pd_cpu / best_cpu, 2)

    result["ttft"] = run_ttft(llm, random.Random(args.seed + 1), vocab_ids, args)
    result["targets"] = {
        "throughput_ratio_ge_2": result.get("throughput_ratio", 0) >= 2.0,
        "ttft_speedup_ge_5": result["ttft"]["speedup"] >= 5.0,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
