"""Decode step time by batch size: `LLMEngine.step()` with B sequences all decoding.

For each B, B requests with distinct `--prompt-len`-token prompts are added and stepped until
every one has its first token (prefills done); then `--steps` steps are timed, each producing
one token for every sequence (scheduling, the model, sampling and output processing: what a
serving step costs). Prints JSON with the median step time and tokens per second.

    python benchmarks/decode_step.py [--device cuda] [--dtype bfloat16] [--batch-sizes 1 8 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from pdserve import LLM, SamplingParams, TokensPrompt
from report import emit


def step_times(llm: LLM, batch: int, prompt_len: int, steps: int, warmup: int,
               first_id: int) -> list[float]:
    engine = llm.llm_engine
    # Long enough that no sequence finishes inside the timed steps, however staggered the
    # chunked prefills start them; they are aborted afterwards.
    room = llm.llm_engine.config.model.max_model_len - prompt_len
    params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        start = first_id + i * prompt_len
        prompt = [(start + j) % 40000 + 100 for j in range(prompt_len)]
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    started: set[str] = set()
    while len(started) < batch:  # prefills (chunked when they exceed the token budget)
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        assert len(outs) == batch, f"a step advanced {len(outs)} of {batch} sequences"
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_num_seqs=max(args.batch_sizes))
    config = llm.llm_engine.config
    rows = []
    for k, batch in enumerate(args.batch_sizes):
        times = step_times(llm, batch, args.prompt_len, args.steps, args.warmup,
                           first_id=k * 997)
        ms = statistics.median(times) * 1e3
        rows.append({"batch": batch, "step_ms_median": round(ms, 2),
                     "step_ms_min": round(min(times) * 1e3, 2),
                     "tokens_per_s": round(batch / (ms / 1e3), 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    device = config.device.device
    result = {"command": "python " + " ".join(["benchmarks/decode_step.py"] + sys.argv[1:]),
              "model": args.model, "device": device,
              "device_name": (torch.cuda.get_device_name() if device == "cuda"
                              else platform.processor() or platform.machine()),
              "dtype": str(config.model.dtype).removeprefix("torch."),
              "torch": torch.__version__, "prompt_len": args.prompt_len, "rows": rows}
    emit(result, args.out)


if __name__ == "__main__":
    main()
