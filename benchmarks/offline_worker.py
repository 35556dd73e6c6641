"""One system's offline run, for vs_vllm.py: the same script drives pdserve and vLLM's CPU build
(`--engine pdserve|vllm`), through the same `LLM` / `SamplingParams` API.

Workloads (random token ids from [100, vocab), fixed seed, greedy unless `--temperature`,
`ignore_eos`):
- `offline`: `--num-requests` prompts of 32-512 tokens, outputs of 16-256 tokens.
- `decode`: 64 prompts of 64 tokens, 128 tokens each (decode-heavy).
- `prefill`: cold prefill, 3 prompts of 2,000 tokens, one at a time, 1 output token each
  (`s_per_request`: the mean time of one).
- `text`: `offline_throughput.py`'s mixed workload (`text_workload.py`): 64 windows of 32-512
  tokens of a fixed English-like text, outputs of 16-256 tokens.
The warm-up's prompts share no prefix with the timed ones (`cached_prompt_tokens` reports hits).
`requests_sha` fingerprints the requests, so runs in the two systems can be checked to be alike.
Both systems' KV caches are resident from the start (vLLM's CPU build always zero-fills its
cache; pdserve is given `kv_cache_prefault`), so neither pays first-use page faults in the
timed part. A small warm-up runs first; the timed `generate` reports wall time and this
process's CPU time (vLLM runs its engine in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import time

from text_workload import text_workload


def workload(kind: str, n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if kind == "decode":
        return [([rng.randrange(100, vocab) for _ in range(64)], 128) for _ in range(64)]
    if kind == "prefill":
        return [([rng.randrange(100, vocab) for _ in range(2000)], 1) for _ in range(4)]
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))],
             rng.randint(16, 256)) for _ in range(n)]


def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["pdserve", "vllm"], required=True)
    p.add_argument("--model", required=True, help="a Hugging Face directory")
    p.add_argument("--workload", choices=["offline", "decode", "prefill", "text"],
                   default="offline")
    p.add_argument("--num-requests", type=int, default=None,
                   help="offline: 48 unless given; text: 64 unless given")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                   help="vLLM's speculative_config for both systems, e.g. "
                        '\'{"method": "ngram", "num_speculative_tokens": 3}\'')
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the timed requests' temperature (0: greedy); sampled runs draw from "
                        "each system's generator seeded with --seed")
    args = p.parse_args()
    spec = {"speculative_config": args.speculative_config} if args.speculative_config else {}
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM, SamplingParams
        llm = LLM(args.model, dtype="float32", max_model_len=2048, seed=args.seed, **spec)
    else:
        from pdserve import LLM, SamplingParams
        llm = LLM(args.model, dtype="float32", max_model_len=2048,
                  kv_cache_memory_bytes=2 << 30, kv_cache_prefault=True, seed=args.seed, **spec)
    tokenizer = llm.get_tokenizer()
    if args.workload == "text":
        _, reqs = text_workload(tokenizer, args.seed, args.num_requests or 64)
    else:
        reqs = workload(args.workload, args.num_requests or 48, len(tokenizer), args.seed)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True)
              for _, n in reqs]
    # random ids of another seed: no prefix block in common with the timed prompts
    warm = [{"prompt_token_ids": ids} for ids, _ in
            workload("offline", 2, len(tokenizer), args.seed + 1)]
    if args.workload == "prefill":  # the first prompt warms up; the others are timed cold
        warm, prompts, params, reqs = prompts[:1], prompts[1:], params[1:], reqs[1:]
    llm.generate(warm, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
                 * len(warm), use_tqdm=False)
    c0, t0 = cpu_seconds(), time.perf_counter()
    if args.workload == "prefill":
        outs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(n for _, n in reqs), "an output ended early"
    print(json.dumps({"engine": args.engine, "workload": args.workload, "tokens": tokens,
                      "wall_s": wall, "cpu_s": cpu, "tok_per_s": tokens / wall,
                      "tok_per_cpu_s": tokens / cpu,
                      "prompt_tokens": sum(len(ids) for ids, _ in reqs),
                      "cached_prompt_tokens": sum(getattr(o, "num_cached_tokens", 0) or 0
                                                  for o in outs),
                      "requests_sha": hashlib.sha256(json.dumps(reqs).encode()).hexdigest()[:16],
                      "s_per_request": wall / len(reqs)}))


if __name__ == "__main__":
    main()
