"""Shared cores: offline throughput and tokens per CPU-second, alone and beside one other
CPU-bound process, for OpenMP barrier-wait settings.

Each configuration runs in a fresh process (libgomp reads its settings when torch loads it):
`--num-requests` greedy requests (prompts of 64-184 real-text tokens, `--max-tokens` new
tokens each, `ignore_eos`) through `LLM.generate` on the bundled SmolLM2, float32, timed after
a warm-up. Configurations: libgomp's default spin (GOMP_SPINCOUNT=300000, what torch does
unless told), pdserve's default (1000, set by `import pdserve`), a passive wait (0), and one
compute thread. "Busy" runs start `python -c 'while 1: pass'` first and stop it after.
Rounds alternate the configurations; medians.

    python benchmarks/cpu_budget.py --out benchmarks/results/cpu_budget.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "libgomp_default_spin": {"GOMP_SPINCOUNT": "300000"},
    "pdserve_default_spin": {},
    "passive_wait": {"GOMP_SPINCOUNT": "0"},
    "one_thread": {"OMP_NUM_THREADS": "1"},
}
TEXT = "The river ran past the old mill where the miller's daughter kept a ledger. " * 30


def measure(num_requests: int, max_tokens: int) -> dict:
    """One run in this process (the configuration is in its environment)."""
    from pdserve import LLM, SamplingParams  # first: it sets pdserve's default before torch

    import torch

    llm = LLM("SmolLM2-135M-Instruct", kv_cache_memory_bytes=256 << 20)
    ids = llm.get_tokenizer().encode(TEXT)
    prompts = [{"prompt_token_ids": ids[i * 5:i * 5 + 64 + 8 * i]} for i in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_per_s": tokens / wall, "tok_per_cpu_s": tokens / cpu,
            "threads": torch.get_num_threads(), "spin": os.environ.get("GOMP_SPINCOUNT")}


def run_config(env: dict, busy: bool, args) -> dict:
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if busy else None
    try:
        out = subprocess.run([sys.executable, __file__, "--child", "--num-requests",
                              str(args.num_requests), "--max-tokens", str(args.max_tokens)],
                             env={**os.environ, **env}, capture_output=True, text=True,
                             check=True)
    finally:
        if hog:
            hog.kill()
            hog.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.num_requests, args.max_tokens)))
        return
    runs: dict[str, list[dict]] = {}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for busy in (False, True):
            for name, env in CONFIGS.items():
                key = f"{name}/{'busy' if busy else 'alone'}"
                runs.setdefault(key, []).append(run_config(env, busy, args))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("tok_per_s", "tok_per_cpu_s")}
           for k, v in runs.items()}
    kept = {name: med[f"{name}/busy"]["tok_per_cpu_s"] / med[f"{name}/alone"]["tok_per_cpu_s"]
            for name in CONFIGS}
    report = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load_before": load_before,
              "load_after": os.getloadavg(), "median": med,
              "busy_over_alone_tok_per_cpu_s": kept, "runs": runs}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
