"""1P1D against colocated, on the same workload and machine, through the same router.

Colocated: one decode instance that prefills everything itself (the router's disaggregation
threshold set above every prompt). 1P1D: a prefill and a decode instance, every prompt
disaggregated (threshold 0), both on every core, taking turns to compute steps as `pdserve up`
runs them (cpu_turns.py); 1P1D split: each on its own share of the cores; 1P1D shared: both on
every core without turns. `--disagg-min-running 12` gives the 1P1D topologies `pdserve up`'s
rule for shared cores instead: a prompt is disaggregated only while the decode instance runs 12
requests or more. All are driven through `Router.Generate` by the same closed-loop clients, so
the ratios compare only the serving topology.

    python benchmarks/disagg_vs_colocated.py --rounds 2 \
        --out benchmarks/results/disagg_vs_colocated_turns.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time

import grpc

from pdserve.cluster import Cluster, ClusterSpec
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(128, 512))],
             rng.randint(32, 96)) for _ in range(n)]


def one_request(stub, ids: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, disaggregated = [], False
    for msg in stub.Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True)), timeout=600):
        stamps.extend([time.perf_counter()] * len(msg.token_ids))
        disaggregated |= msg.served_by.disaggregated
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > a]
    return {"ttft": stamps[0] - start, "itl": gaps, "tokens": len(stamps),
            "e2e": stamps[-1] - start, "disaggregated": disaggregated}


def drive(address: str, requests, concurrency: int) -> dict:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
    one_request(stub, requests[0][0][:32], 4)  # warm-up
    results, lock, queue = [], threading.Lock(), list(requests)

    def client():
        while True:
            with lock:
                if not queue:
                    return
                ids, n = queue.pop()
            r = one_request(stub, ids, n)
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(g for r in results for g in r["itl"])
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p / 100 * len(xs)))]  # noqa: E731
    return {"requests": len(results), "output_tokens_per_s": sum(r["tokens"] for r in results)
            / wall, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99), "wall_s": wall,
            "ttft_mean_s": statistics.mean(ttft),
            "disaggregated_share": sum(r["disaggregated"] for r in results) / len(results)}


SHARING = {"colocated": "turns", "1p1d": "turns", "1p1d_split": "split",
           "1p1d_shared": "shared"}


def run(topology: str, args, requests) -> dict:
    disagg = topology.startswith("1p1d")
    spec = ClusterSpec(model=args.model, num_prefill=1 if disagg else 0,
                       num_decode=1, connector=args.connector, grpc_port=0,
                       disagg_threshold=0 if disagg else 10**9,
                       kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                       disagg_min_running=args.disagg_min_running if disagg else 0,
                       cpu_sharing=SHARING[topology])
    with Cluster(spec) as cluster:
        return drive(cluster.router_address, requests, args.concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--connector", default="shm")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disagg-min-running", type=int, default=0,
                        help="1P1D: requests the decode instance must already run for a prompt "
                             "to be disaggregated (0: every prompt is)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every topology this many times, interleaved, the order "
                             "reversed in every other round")
    parser.add_argument("--topologies", default=",".join(SHARING),
                        help=f"comma-separated, from {', '.join(SHARING)}")
    parser.add_argument("--out")
    args = parser.parse_args()
    topologies = args.topologies.split(",")
    requests = workload(args.requests, args.seed)
    load_before = os.getloadavg()
    # the order turns round by round: a run after other work is often slower on a shared host
    rounds = [{t: run(t, args, requests) for t in (topologies[::-1] if i % 2 else topologies)}
              for i in range(args.rounds)]
    keys = ["output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"]
    ratios = {f"{t}_over_colocated": [{k: r[t][k] / r["colocated"][k] for k in keys}
                                      for r in rounds]
              for t in topologies if t != "colocated" and "colocated" in topologies}
    report = {"workload": {"requests": args.requests, "concurrency": args.concurrency,
                           "prompt_tokens": "128-512", "output_tokens": "32-96",
                           "model": args.model, "connector": args.connector,
                           "disagg_min_running": args.disagg_min_running},
              "load_before": load_before, "load_after": os.getloadavg(), "rounds": rounds,
              "ratios": ratios}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
