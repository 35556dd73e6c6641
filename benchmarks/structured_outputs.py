"""Structured outputs' cost: throughput of a batch where half the requests carry a JSON schema
against the same batch unconstrained, and the time to compile a schema cold and cached.

- Throughput: `--num-requests` prompts (real text windows of `--prompt-len` tokens), all
  greedy with `--max-tokens` new tokens. In the constrained batch every other request carries
  a JSON schema (a compact array of `--items` small integers, long enough that every output
  runs to max_tokens), so both batches generate the same number of tokens and the ratio is the
  masking's cost alone. The two batches alternate `--rounds` times in one process; medians.
- With `--speculative-config JSON` (vLLM's, e.g. n-gram drafts), a second engine with drafts
  runs the same two batches in the same rounds, and the ratios with and without drafts are
  reported; greedy outputs must be the same tokens in both engines.
- Compile: `--schemas` distinct schemas (an object with 8 typed properties, each schema with
  different property names) compiled through the engine's StructuredOutputManager: cold
  (first sight) and cached (the same schema again). The tokenizer's one-time setup is
  reported apart.

Prints one JSON document; `--out FILE` also writes it there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

TEXT = ("The river ran past the old mill where the miller's daughter kept a ledger of every "
        "sack of grain, every coin and every promise made in the long winter. ") * 40


def array_schema(items: int) -> dict:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": items, "maxItems": items}


def object_schema(i: int) -> dict:
    kinds = ["string", "integer", "number", "boolean"]
    props = {f"field_{i}_{j}": {"type": kinds[j % 4]} for j in range(8)}
    return {"type": "object", "properties": props, "required": list(props)}


def throughput(llm: LLM, args, drafting: LLM | None = None) -> dict:
    tok = llm.get_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    prompts = [{"prompt_token_ids": ids[i * 7:i * 7 + args.prompt_len]}
               for i in range(args.num_requests)]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    schema = StructuredOutputsParams(json=array_schema(args.items), disable_any_whitespace=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs=schema)
    batches = {"unconstrained": [free] * len(prompts),
               "half_json_schema": [constrained if i % 2 else free
                                    for i in range(len(prompts))]}
    engines = {"": llm} if drafting is None else {"": llm, ", drafts": drafting}
    for engine in engines.values():  # warm up, compile once
        engine.generate(prompts[:2], [free, constrained], use_tqdm=False)
    runs: dict[str, list[float]] = {name + e: [] for name in batches for e in engines}
    for _ in range(args.rounds):
        for name, params in batches.items():
            tokens_of = {}
            for e, engine in engines.items():
                start = time.perf_counter()
                outs = engine.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens_of[e] = [o.outputs[0].token_ids for o in outs]
                tokens = sum(map(len, tokens_of[e]))
                assert tokens == args.max_tokens * len(prompts), "an output ended early"
                runs[name + e].append(tokens / seconds)
            assert all(t == tokens_of[""] for t in tokens_of.values()), "drafts changed tokens"
    med = {name: statistics.median(v) for name, v in runs.items()}
    result = {"tok_per_s": runs, "median_tok_per_s": med,
              "ratio_half_constrained": med["half_json_schema"] / med["unconstrained"]}
    if drafting is not None:
        sched = drafting.llm_engine.scheduler
        result |= {"ratio_drafts": {name: med[name + ", drafts"] / med[name] for name in batches},
                   "drafts": {"verified": sched.num_drafts, "tokens": sched.num_draft_tokens,
                              "kept": sched.num_accepted_tokens}}
    return result


def compile_times(llm: LLM, args) -> dict:
    manager = llm.llm_engine.input_processor.grammars
    start = time.perf_counter()
    manager.grammar_for(StructuredOutputsParams(regex="x").spec).future.result()
    setup = time.perf_counter() - start  # the tokenizer's one-time setup, and a tiny compile
    cold, cached = [], []
    for i in range(args.schemas):
        spec = StructuredOutputsParams(json=object_schema(i)).spec
        for times in (cold, cached):
            start = time.perf_counter()
            manager.grammar_for(spec).future.result()
            times.append(time.perf_counter() - start)
    return {"tokenizer_setup_s": setup, "cold_ms": 1e3 * statistics.median(cold),
            "cached_ms": 1e3 * statistics.median(cached),
            "cold_ms_all": [1e3 * t for t in cold]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--schemas", type=int, default=10)
    p.add_argument("--speculative-config", default=None,
                   help="vLLM's speculative_config (JSON) for a second engine, with drafts")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    llm = LLM(args.model, kv_cache_memory_bytes=512 << 20)
    drafting = None if args.speculative_config is None else LLM(
        args.model, kv_cache_memory_bytes=512 << 20, speculative_config=args.speculative_config)
    result = {"command": " ".join(sys.argv), "load_before": os.getloadavg(),
              "compile": compile_times(llm, args),
              "throughput": throughput(llm, args, drafting),
              "load_after": os.getloadavg(), "cpus": os.cpu_count()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
