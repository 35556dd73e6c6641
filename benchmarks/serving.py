"""Online serving benchmark over the OpenAI-format HTTP API: pdserve colocated, pdserve 1P1D
and (optionally) vLLM's CPU build, one after the other on the same workload, in one run.

Systems (each started here, measured, stopped before the next starts; CPU is scarce):
- `colocated`: `pdserve serve` (one engine in the gateway process), started as
  `python -m pdserve.gateway.server`.
- `1p1d`: `pdserve up` (router + 1 prefill + 1 decode instance, `pdserve.cluster.Cluster`)
  with the gateway in front of its router (`python -m pdserve.gateway.server --router ADDR`).
- `vllm`: `PY -m vllm.entrypoints.openai.api_server` when `--vllm-python PY` is given (a venv
  with vLLM's CPU build), on `--vllm-model` (a Hugging Face directory: vLLM's CPU build does
  not load GGUF). Skipped with a message otherwise.

Workload: `--num-prompts` requests, prompts of random token ids (fixed `--seed`; ids from
[100, vocab), so no two prompts share a prefix) with lengths uniform in `--input-len`, outputs
uniform in `--output-len`, greedy with `ignore_eos` so every system generates exactly the same
number of tokens. Sent to /v1/completions with `stream: true`, either open-loop (`--rate R`:
Poisson arrivals, R requests/s) or closed-loop (`--concurrency N` requests in flight).

Reported per system: TTFT, inter-token latency (gaps between streamed chunks), TPOT and
end-to-end latency p50/p90/p99; request, output-token and total-token throughput; goodput:
requests/s meeting the SLO (TTFT <= `--slo-ttft-s` and TPOT <= `--slo-tpot-s`). JSON on stdout
and in `--out`; a PNG of the latency distributions in `--plot`. Compare ratios, not absolute
numbers: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.models.loader import DEFAULT_MODEL, load_arch, resolve_model
from serving_systems import MODEL_NAME, SYSTEMS, Skip

MIN_TOKEN_ID = 100  # below: special tokens


# --------------------------------------------------------------------------- workload
@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float] | None  # seconds after start (rate mode), else None


def make_workload(args, vocab_size: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    in_lens = rng.integers(args.input_len[0], args.input_len[1] + 1, n)
    out_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, n)
    prompts = [rng.integers(MIN_TOKEN_ID, vocab_size, int(k)).tolist() for k in in_lens]
    arrivals = None
    if args.rate:
        arrivals = np.cumsum(rng.exponential(1.0 / args.rate, n)).tolist()
    return Workload(prompts, [int(k) for k in out_lens], arrivals)


# --------------------------------------------------------------------------- client
@dataclass
class Record:
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send(client: httpx.AsyncClient, url: str, prompt: list[int], out_len: int) -> Record:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": out_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    rec = Record(len(prompt))
    start = time.perf_counter()
    chunks: list[float] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    rec.error = str(obj["error"])[:200]
                if obj.get("choices"):
                    chunks.append(time.perf_counter())
                if obj.get("usage"):
                    rec.output_tokens = obj["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    end = time.perf_counter()
    if chunks:
        rec.ttft = chunks[0] - start
        rec.itls = np.diff(chunks).tolist()
    rec.e2e = end - start
    rec.output_tokens = rec.output_tokens or len(chunks)
    if rec.output_tokens != out_len and rec.error is None:
        rec.error = f"generated {rec.output_tokens} tokens, asked {out_len}"
    return rec


async def run_workload(url: str, w: Workload, concurrency: int | None,
                       timeout_s: float) -> tuple[list[Record], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency or len(w.prompts))
        start = time.perf_counter()

        async def one(i: int) -> Record:
            if w.arrivals is not None:
                await asyncio.sleep(max(0.0, start + w.arrivals[i] - time.perf_counter()))
            async with sem:
                return await send(client, url, w.prompts[i], w.output_lens[i])

        records = await asyncio.gather(*(one(i) for i in range(len(w.prompts))))
        return list(records), time.perf_counter() - start


def pcts(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def summarize(records: list[Record], wall: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in records if r.error is None]
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "output_token_throughput": out_tokens / wall,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / wall,
        "goodput_req_s": len(good) / wall,
        "slo_attainment": len(good) / len(records) if records else 0.0,
        "ttft_s": pcts([r.ttft for r in ok]),
        "itl_s": pcts([x for r in ok for x in r.itls]),
        "tpot_s": pcts([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": pcts([r.e2e for r in ok]),
    }


# --------------------------------------------------------------------------- run
def bench_system(name: str, args, w: Workload, logs: Path) -> dict:
    print(f"[{name}] starting", file=sys.stderr, flush=True)
    try:
        url, stop = SYSTEMS[name](args, logs)
    except Skip as e:
        print(f"[{name}] skipped: {e}", file=sys.stderr, flush=True)
        return {"status": "skipped", "reason": str(e)}
    try:
        warm = Workload(w.prompts[:2], [4, 4], None)
        asyncio.run(run_workload(url, warm, None, args.timeout_s))
        print(f"[{name}] running {len(w.prompts)} requests", file=sys.stderr, flush=True)
        records, wall = asyncio.run(run_workload(url, w, args.concurrency, args.timeout_s))
    finally:
        stop()
    result = {"status": "ok", **summarize(records, wall, args.slo_ttft_s, args.slo_tpot_s),
              "loadavg_1m_after": os.getloadavg()[0]}
    result["requests"] = [asdict(r) | {"tpot": r.tpot} for r in records]
    print(f"[{name}] {result['output_token_throughput']:.1f} output tok/s, TTFT p50 "
          f"{result['ttft_s']['p50']}, failed {result['failed']}", file=sys.stderr, flush=True)
    return result


def ratios(results: dict) -> dict:
    base = results.get("colocated", {})
    if base.get("status") != "ok":
        return {}
    out = {}
    for name, r in results.items():
        if name == "colocated" or r.get("status") != "ok":
            continue
        out[f"{name}/colocated"] = {
            "output_token_throughput": r["output_token_throughput"]
            / base["output_token_throughput"],
            "goodput": (r["goodput_req_s"] / base["goodput_req_s"]
                        if base["goodput_req_s"] else None),
            "ttft_p50": r["ttft_s"]["p50"] / base["ttft_s"]["p50"],
            "itl_p50": r["itl_s"]["p50"] / base["itl_s"]["p50"],
            "e2e_p50": r["e2e_s"]["p50"] / base["e2e_s"]["p50"]}
    return out


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("TTFT (s)", lambda r: [x["ttft"] for x in r["requests"] if x["ttft"]]),
              ("inter-token latency (s)",
               lambda r: [g for x in r["requests"] if not x["error"] for g in x["itls"]]),
              ("end-to-end latency (s)",
               lambda r: [x["e2e"] for x in r["requests"] if not x["error"]])]
    for ax, (label, values) in zip(axes, panels):
        for name, r in results.items():
            if r.get("status") != "ok":
                continue
            v = np.sort(np.asarray(values(r)))
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--systems", default="colocated,1p1d,vllm",
                   help="comma-separated: colocated, 1p1d, vllm")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 400], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[8, 96], metavar=("MIN", "MAX"))
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    load.add_argument("--concurrency", type=int, default=None, help="requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-s", type=float, default=5.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--engine-args", default="",
                   help="more engine flags for pdserve's engines, e.g. "
                        "'--max-prefill-tokens-with-decodes 2048'")
    p.add_argument("--vllm-args", default="",
                   help="more flags for vLLM's server, e.g. "
                        "'--speculative-config \'{\"method\": \"ngram\"}\''")
    p.add_argument("--connector", default="shm", choices=["shm", "tcp", "nixl"])
    p.add_argument("--disagg-threshold", type=int, default=0,
                   help="1p1d: uncached prompt tokens from which a prompt goes to the prefill "
                        "instance (0: every prompt)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build")
    p.add_argument("--vllm-model", default=None, help="Hugging Face directory for vLLM")
    p.add_argument("--vllm-startup-s", type=float, default=600)
    p.add_argument("--timeout-s", type=float, default=600, help="per request")
    p.add_argument("--out", default=None, help="write the JSON here too")
    p.add_argument("--plot", default=None, help="write a PNG of the latency distributions")
    p.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 8, [16, 64], [4, 16]
    if args.rate is None and args.concurrency is None:
        args.concurrency = 8
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/serving.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load_start = os.getloadavg()[0]  # other work on the machine skews everything
    vocab = load_arch(resolve_model(args.model)).vocab_size
    w = make_workload(args, vocab)
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-serving-"))
    results = {name: bench_system(name, args, w, logs) for name in args.systems.split(",")}
    load = (f"Poisson {args.rate} req/s" if args.rate else f"concurrency {args.concurrency}")
    doc = {
        "command": command,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "loadavg_1m_at_start": load_start},
        "workload": {"model": args.model, "num_prompts": args.num_prompts,
                     "input_len": args.input_len, "output_len": args.output_len,
                     "load": load, "seed": args.seed, "dtype": args.dtype,
                     "prompt_tokens": sum(len(p) for p in w.prompts),
                     "output_tokens": sum(w.output_lens)},
        "slo": {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s},
        "logs": str(logs),
        "ratios": ratios(results),
        "results": results,
    }
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(results, args.plot, f"{Path(args.model).name}, {args.num_prompts} requests, "
                                 f"{load}, prompts {args.input_len}, outputs {args.output_len}")
    summary = {k: v for k, v in doc.items() if k != "results"}
    summary["results"] = {n: {k: v for k, v in r.items() if k != "requests"}
                          for n, r in results.items()}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
