"""How far pdserve's offline run is from this machine's floor: the time its steps would take if
their matrix products ran at the best GEMM rate measured here, or streamed their weights at the
memory's read rate where that takes longer, and their attention cost only its own arithmetic
(prompts) or the reads of its keys and values (decodes).

Runs one of offline_worker.py's workloads (`offline` or `text`) through pdserve's `LLM`,
timing every engine step and recording its chunks. The rates are measured in the same
process, just before: torch's `F.linear` over a stack of distinct weights of the model's
shapes (every layer's projections, as a step streams them) at several row counts (the floor
takes the best rate of all, as if every step were large), and the read rate of a 512 MB
tensor. A step's floor is
- matrix products: its projections (every token) and LM head (the rows it samples) at the
  GEMM rate, or its float32 weights at the read rate if that is longer (a few rows);
- attention: a decode's keys and values (context x kv heads x head size x 2, float32, every
  layer) at the read rate; a prompt chunk's score and value products at the GEMM rate.
Norms, rotary, sampling and the engine's Python are not in it. The sum over steps, set
against the measured wall time, says how much of the run is left above the floor, for
prompt-carrying steps and decode-only steps apart, and so what any system's time on the same
requests can at best be on this machine. Prints JSON.

    python benchmarks/offline_floor.py [--workload offline|text] [--hf-dir /tmp/smollm2-hf]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from offline_worker import workload
from text_workload import text_workload

ROWS = (8, 32, 128, 512)  # where torch's GEMM rate is measured


def projection_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of every decoder layer's projections: qkv, o, gate_up, down."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)] * cfg["num_hidden_layers"]


@dataclass(frozen=True)
class Floor:
    """What a step's floor is computed from: the model's sizes and the machine's rates."""

    params: int  # projection weights, every layer
    head_params: int  # LM head weights
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    flops_per_s: float  # the best GEMM rate
    bytes_per_s: float  # the read rate

    @classmethod
    def of(cls, cfg: dict, flops_per_s: float, bytes_per_s: float) -> Floor:
        heads = cfg["num_attention_heads"]
        return cls(sum(o * i for o, i in projection_shapes(cfg)),
                   cfg["vocab_size"] * cfg["hidden_size"], cfg["num_hidden_layers"], heads,
                   cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   flops_per_s, bytes_per_s)

    def step(self, chunks: list[tuple[int, int, bool]]) -> dict[str, float]:
        """The floor of one step of chunks (start, tokens, samples a token), in seconds:
        matrix products, decode attention (one-token chunks) and prompt attention."""
        tokens = sum(n for _, n, _ in chunks)
        sampled = sum(done for _, _, done in chunks)
        flops = 2 * (tokens * self.params + sampled * self.head_params)
        weight_bytes = 4 * (self.params + (self.head_params if sampled else 0))
        # a decode at position s reads s + 1 keys and values; prompt query s + i sees s + i + 1
        kv_row = self.kv_heads * self.head_dim * 2 * 4 * self.layers
        decode_bytes = sum((s + 1) * kv_row for s, n, _ in chunks if n == 1)
        seen = sum(n * s + n * (n + 1) // 2 for s, n, _ in chunks if n > 1)
        prompt_flops = seen * self.heads * self.head_dim * 4 * self.layers
        return {"matmul_s": max(flops / self.flops_per_s, weight_bytes / self.bytes_per_s),
                "decode_attention_s": decode_bytes / self.bytes_per_s,
                "prompt_attention_s": prompt_flops / self.flops_per_s}


def matmul_seconds(shapes: list[tuple[int, int]], rows: int, reps: int = 3) -> float:
    """The best time of `rows` rows through every weight of `shapes` (distinct weights)."""
    weights = [torch.randn(o, i) for o, i in shapes]
    x = {i: torch.randn(rows, i) for i in {i for _, i in shapes}}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for w in weights:
                F.linear(x[w.shape[1]], w)
            best = min(best, time.perf_counter() - t0)
    return best


def read_bytes_per_s(megabytes: int = 512, seconds: float = 2.0) -> float:
    a = torch.ones(megabytes << 18)  # float32
    a.sum()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a.sum()
        n += 1
    return n * a.numel() * 4 / (time.perf_counter() - t0)


class StepLog:
    """Wraps ModelRunner.execute: every step's chunks (start, tokens, samples) and wall time."""

    def __init__(self) -> None:
        from pdserve.engine import model_runner
        self.steps: list[tuple[list[tuple[int, int, bool]], float]] = []
        inner = model_runner.ModelRunner.execute

        def execute(runner, sched):
            t0 = time.perf_counter()
            out = inner(runner, sched)
            chunks = [(c.start, c.num_tokens, c.completes_sequence) for c in sched.chunks]
            self.steps.append((chunks, time.perf_counter() - t0))
            return out
        model_runner.ModelRunner.execute = execute


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["offline", "text"], default="offline")
    p.add_argument("--hf-dir", type=Path, default=Path("/tmp/smollm2-hf"),
                   help="the model as a Hugging Face directory (vs_vllm.py writes it)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    cfg = json.loads((args.hf_dir / "config.json").read_text())
    shapes = projection_shapes(cfg)
    params = sum(o * i for o, i in shapes)
    gemm = {r: 2 * r * params / matmul_seconds(shapes, r) for r in ROWS}  # FLOP/s
    floor_of = Floor.of(cfg, max(gemm.values()), read_bytes_per_s())

    from pdserve import LLM, SamplingParams
    llm = LLM(str(args.hf_dir), dtype="float32", max_model_len=2048,
              kv_cache_memory_bytes=2 << 30, kv_cache_prefault=True, seed=args.seed)
    tok = llm.get_tokenizer()
    reqs = (text_workload(tok, args.seed, 64)[1] if args.workload == "text"
            else workload("offline", 48, len(tok), args.seed))
    warm = [{"prompt_token_ids": ids} for ids, _ in workload("offline", 2, len(tok), args.seed + 1)]
    llm.generate(warm, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 2,
                 use_tqdm=False)
    log = StepLog()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids, _ in reqs],
                 [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs],
                 use_tqdm=False)
    wall = time.perf_counter() - t0

    split = {kind: {"steps": 0, "wall_s": 0.0, "floor_s": 0.0, "matmul_s": 0.0,
                    "decode_attention_s": 0.0, "prompt_attention_s": 0.0}
             for kind in ("with_prompt", "decode_only")}
    for chunks, seconds in log.steps:
        part = floor_of.step(chunks)
        bucket = split["decode_only" if all(n == 1 for _, n, _ in chunks) else "with_prompt"]
        bucket["steps"] += 1
        bucket["wall_s"] += seconds
        bucket["floor_s"] += sum(part.values())
        for key, value in part.items():
            bucket[key] += value
    floor = sum(bucket["floor_s"] for bucket in split.values())
    tokens = sum(n for _, n in reqs)
    print(json.dumps({
        "command": "python benchmarks/offline_floor.py --workload " + args.workload,
        "load_before": load_before, "load_after": os.getloadavg()[0], "workload": args.workload,
        "tokens": tokens, "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 1),
        "floor_s": round(floor, 2), "floor_tok_per_s": round(tokens / floor, 1),
        "wall_over_floor": round(wall / floor, 2),
        "gemm_gflops_at_rows": {r: round(f / 1e9, 1) for r, f in gemm.items()},
        "read_gb_per_s": round(floor_of.bytes_per_s / 1e9, 1),
        "split": {kind: {key: round(v, 2) for key, v in bucket.items()}
                  for kind, bucket in split.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
