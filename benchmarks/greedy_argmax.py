"""Decode step time with greedy tokens taken by the native argmax (kernels/csrc/argmax.c) and by
torch's, interleaved in one process on SmolLM2: `decode_step.step_times` for each batch size,
the two argmaxes alternating in order from round to round. Prints JSON: each step's median
per round, in ms, and the 1-minute load before.

    python benchmarks/greedy_argmax.py [--rounds 4] [--batch-sizes 16 48 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics

from decode_step import step_times
from report import emit

import pdserve.engine.sampler as sampler
from pdserve import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 48, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    kinds = {"native": sampler.argmax_rows, "torch": lambda logits: logits.argmax(dim=-1)}
    llm = LLM("SmolLM2-135M-Instruct", kv_cache_memory_bytes=2 << 30)
    result = {"load_before": os.getloadavg()[0], "median_step_ms": {k: {} for k in kinds}}
    first = 0
    for rnd in range(args.rounds):
        for kind in (("native", "torch") if rnd % 2 == 0 else ("torch", "native")):
            sampler.argmax_rows = kinds[kind]
            for batch in args.batch_sizes:
                times = step_times(llm, batch, args.prompt_len, args.steps, 3, first)
                first += batch * args.prompt_len
                result["median_step_ms"][kind].setdefault(batch, []).append(
                    round(statistics.median(times) * 1000, 2))
    emit(result, args.out)


if __name__ == "__main__":
    main()
