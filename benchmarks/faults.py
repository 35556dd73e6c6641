"""Faults and load on a local cluster with default settings: what completes, fails or hangs.

Each case starts a fresh cluster (2 prefill, 2 decode instances by default, tcp), sends
`--requests` concurrent streaming requests through the router (prompts of 32-512 tokens of the
bundled model's vocabulary, 32-256 output tokens, greedy, `ignore_eos`), and strikes once the
first tokens are out:
- healthy: nothing;
- decode_killed: SIGKILL a decode instance mid-stream (its requests migrate);
- prefill_killed: SIGKILL a prefill instance as the requests arrive;
- clients_disconnect: a quarter of the clients cancel mid-stream.
Then a load run: `--load-streams` concurrent streams on a 1P1D cluster with every default.
Per case: requests completed / failed (with a clear status) / hung (no answer by the
deadline), migrations, TTFT and end-to-end p50/p99 of the completed ones. Prints JSON.

    python benchmarks/faults.py [--model M] [--requests 16] [--load-streams 64] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.cluster import Cluster, ClusterSpec  # noqa: E402
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402
from report import emit  # noqa: E402

DEADLINE_S = 600.0


def workload(n: int, seed: int, max_prompt: int = 512, max_output: int = 256) -> list:
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(32, max_prompt))],
             rng.randint(32, max_output)) for _ in range(n)]


class Client(threading.Thread):
    """One streaming request; records its outcome and timings."""

    def __init__(self, stub, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.stub, self.prompt, self.max_tokens = stub, prompt, max_tokens
        self.call = None
        self.status, self.ttft, self.e2e, self.migrations = "hung", None, None, 0
        self.started = threading.Event()

    def run(self) -> None:
        request = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=self.prompt), sampling=common_pb2.SamplingParams(
                temperature=0, max_tokens=self.max_tokens, ignore_eos=True))
        t0 = time.perf_counter()
        try:
            self.call = self.stub.Generate(request, timeout=DEADLINE_S)
            for msg in self.call:
                if self.ttft is None and msg.token_ids:
                    self.ttft = time.perf_counter() - t0
                    self.started.set()
                if msg.HasField("served_by"):
                    self.migrations = msg.served_by.migrations
            self.status, self.e2e = "completed", time.perf_counter() - t0
        except grpc.RpcError as e:
            self.status = e.code().name.lower()
        finally:
            self.started.set()


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def run_case(name: str, spec: ClusterSpec, reqs: list, strike) -> dict:
    with Cluster(spec) as cluster:
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
        clients = [Client(stub, p, m) for p, m in reqs]
        t0 = time.perf_counter()
        for c in clients:
            c.start()
        strike(cluster, clients)
        for c in clients:
            c.join(DEADLINE_S + 30)
        wall = time.perf_counter() - t0
    done = [c for c in clients if c.status == "completed"]
    statuses: dict[str, int] = {}
    for c in clients:
        statuses[c.status] = statuses.get(c.status, 0) + 1
    row = {"case": name, "requests": len(clients), "outcomes": statuses,
           "migrations": sum(c.migrations for c in clients), "wall_s": round(wall, 2),
           "ttft_p50_s": pct([c.ttft for c in done], 0.5),
           "ttft_p99_s": pct([c.ttft for c in done], 0.99),
           "e2e_p50_s": pct([c.e2e for c in done], 0.5),
           "e2e_p99_s": pct([c.e2e for c in done], 0.99)}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def after_first_tokens(count: int, action):
    def strike(cluster, clients):
        deadline = time.monotonic() + DEADLINE_S
        while sum(c.ttft is not None for c in clients) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        action(cluster, clients)
    return strike


def kill(name: str):
    return lambda cluster, clients: cluster.child(name).proc.send_signal(signal.SIGKILL)


def cancel_quarter(cluster, clients) -> None:
    for c in clients[::4]:
        if c.call is not None:
            c.call.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--load-streams", type=int, default=64)
    ap.add_argument("--connector", default="tcp", choices=["shm", "tcp"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    spec = ClusterSpec(model=args.model, connector=args.connector, num_prefill=2, num_decode=2,
                       grpc_port=0, startup_timeout_s=600)
    reqs = workload(args.requests, args.seed)
    cases = [("healthy", lambda cluster, clients: None),
             ("decode_killed", after_first_tokens(max(1, len(reqs) // 2), kill("decode-0"))),
             ("prefill_killed", kill("prefill-0")),
             ("clients_disconnect", after_first_tokens(max(1, len(reqs) // 2), cancel_quarter))]
    rows = [run_case(name, spec, reqs, strike) for name, strike in cases]
    load_spec = ClusterSpec(model=args.model, connector=args.connector, grpc_port=0,
                            startup_timeout_s=600)
    rows.append(run_case(f"load_{args.load_streams}_streams", load_spec,
                         workload(args.load_streams, args.seed + 1, 256, 64),
                         lambda cluster, clients: None))
    result = {"command": "python " + " ".join(["benchmarks/faults.py"] + sys.argv[1:]),
              "model": args.model, "connector": args.connector, "cpu_count": os.cpu_count(),
              "load_avg_at_start": os.getloadavg()[0], "rows": rows}
    emit(result, args.out)


if __name__ == "__main__":
    main()
