"""Routing benchmark: replay the Mooncake traces through router policies on simulated instances.

Each simulated instance is an LRU prefix cache of `--capacity` blocks (512 tokens, the traces'
block size) and a FIFO server: a request occupies it for
    uncached_prompt_tokens / PREFILL_TPS + output_tokens * OUTPUT_TOKEN_S
seconds. Its queue (what the load scorer sees) is the backlog of assigned, unfinished work in
prompt-token units and the number of unfinished requests. The cache is read and updated when a
request is routed; blocks are touched tail first so a prompt's head stays longest (as the block
pool frees). The prefix-aware policy reads the real `MemoryPrefixIndex`, fed with the KV events
the simulated caches emit.

Policies: round-robin, load-only (queue scorer), prefix-only, prefix-aware (prefix + queue), and
the pooled bound (one LRU of N x capacity; hit ratio only). Then decision latency (index match +
scoring + pick) with `--index-blocks` indexed blocks, in memory and in a real redis-server on
loopback, beside Redis PING round trips measured in the same run. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict, deque
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine.block_pool import BlockRemoved, BlockStored  # noqa: E402
from pdserve.router.kv_events import KVEventSequencer  # noqa: E402
from pdserve.router.memory_index import MemoryPrefixIndex  # noqa: E402
from pdserve.router.picker import PickerConfig, RoundRobinPicker, WeightedPicker  # noqa: E402
from pdserve.router.prefix_index import PrefixIndex  # noqa: E402
from pdserve.router.scorers import InstanceView, QueueScorer, RoutingRequest  # noqa: E402

TRACE_DIR = Path("/work/shared/data/mooncake")
TRACES = ("conversation", "synthetic")
BLOCK_TOKENS = 512
PREFILL_TPS = 20_000.0  # uncached prompt tokens per second per instance
OUTPUT_TOKEN_S = 0.5e-3  # instance time per output token (2,000 output tok/s per instance)
LONG_PROMPT_BLOCKS = (16, 64, 256)  # decision latency vs prompt length (worst case: full hit)


def load_trace(name: str) -> list[dict]:
    with open(TRACE_DIR / f"{name}_trace.jsonl") as f:
        return [json.loads(line) for line in f]


class SimInstance:
    """An LRU prefix cache emitting KV events, plus a FIFO server."""

    def __init__(self, iid: str, capacity: int):
        self.id, self.capacity = iid, capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.events = KVEventSequencer(iid)
        self.busy_until = 0.0
        self.finishes: deque[float] = deque()
        self.requests = 0
        self.compute_s = 0.0

    def view(self, now: float) -> InstanceView:
        while self.finishes and self.finishes[0] <= now:
            self.finishes.popleft()
        backlog = max(0.0, self.busy_until - now)
        return InstanceView(self.id, queued_requests=len(self.finishes),
                            queued_tokens=int(backlog * PREFILL_TPS))

    def serve(self, now: float, req: dict) -> tuple[int, float, list]:
        """Route `req` here: returns (cached blocks, time to first token, KV events)."""
        hashes = req["hash_ids"]
        matched = prefix_hits(self.lru, hashes)
        stored, removed = touch(self.lru, hashes, self.capacity)
        uncached = max(0, req["input_length"] - matched * BLOCK_TOKENS)
        start = max(now, self.busy_until)
        prefill = uncached / PREFILL_TPS
        service = prefill + req["output_length"] * OUTPUT_TOKEN_S
        self.busy_until = start + service
        self.finishes.append(self.busy_until)
        self.requests += 1
        self.compute_s += service
        events = ([BlockStored(tuple(stored), None, len(stored) * BLOCK_TOKENS)] if stored
                  else []) + ([BlockRemoved(tuple(removed))] if removed else [])
        return matched, start - now + prefill, events


def prefix_hits(lru: OrderedDict, hashes: list[int]) -> int:
    n = 0
    for h in hashes:
        if h not in lru:
            break
        n += 1
    return n


def touch(lru: OrderedDict, hashes: list[int], capacity: int) -> tuple[list[int], list[int]]:
    stored, removed = [], []
    for h in reversed(hashes):  # tail first: the head ends most recently used
        if h in lru:
            lru.move_to_end(h)
        else:
            lru[h] = None
            stored.append(h)
    while len(lru) > capacity:
        removed.append(lru.popitem(last=False)[0])
    return stored, removed


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def simulate(trace: list[dict], picker, n: int, capacity: int, use_index: bool) -> dict:
    sims = [SimInstance(f"inst-{i}", capacity) for i in range(n)]
    by_id = {s.id: s for s in sims}
    index = MemoryPrefixIndex(ttl_s=1e9)
    for s in sims:
        index.heartbeat(s.id, {"role": "prefill"})
    hit = total = 0
    ttfts = []
    for req in trace:
        now = req["timestamp"] / 1000.0
        matches = index.match(req["hash_ids"]) if use_index else {}
        request = RoutingRequest(req["input_length"], len(req["hash_ids"]), matches)
        chosen = by_id[picker.pick(request, [s.view(now) for s in sims]).id]
        matched, ttft, events = chosen.serve(now, req)
        if use_index and not index.apply(chosen.events.batch(events)):
            raise RuntimeError("simulated event stream has a gap")
        hit += matched
        total += len(req["hash_ids"])
        ttfts.append(ttft)
    reqs = [s.requests for s in sims]
    comp = [s.compute_s for s in sims]
    return {
        "hit_ratio": round(hit / total, 4),
        "balance_requests": round(max(reqs) / (sum(reqs) / n), 3),
        "balance_compute": round(max(comp) / (sum(comp) / n), 3),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 3),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
    }


def pooled_hit_ratio(trace: list[dict], capacity: int) -> float:
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for req in trace:
        hit += prefix_hits(lru, req["hash_ids"])
        total += len(req["hash_ids"])
        touch(lru, req["hash_ids"], capacity)
    return round(hit / total, 4)


def policies(config: PickerConfig) -> dict:
    return {
        "round_robin": (RoundRobinPicker(), False),
        "load_only": (WeightedPicker([(QueueScorer(config.queue_by), 1.0)]), False),
        "prefix_only": (WeightedPicker.from_config(PickerConfig(1.0, 0.0)), True),
        "prefix_aware": (WeightedPicker.from_config(config), True),
    }


def replay(name: str, args: argparse.Namespace, config: PickerConfig) -> dict:
    trace = load_trace(name)
    out = {"requests": len(trace), "policies": {}}
    for policy, (picker, use_index) in policies(config).items():
        out["policies"][policy] = simulate(trace, picker, args.instances, args.capacity, use_index)
    pooled = pooled_hit_ratio(trace, args.instances * args.capacity)
    out["policies"]["pooled_bound"] = {"hit_ratio": pooled}
    pa, rr = out["policies"]["prefix_aware"], out["policies"]["round_robin"]
    out["targets"] = {
        "prefix_vs_round_robin": round(pa["hit_ratio"] / rr["hit_ratio"], 2),
        "prefix_vs_pooled": round(pa["hit_ratio"] / pooled, 3),
        "met": pa["hit_ratio"] >= 2 * rr["hit_ratio"] and pa["hit_ratio"] >= 0.9 * pooled
        and max(pa["balance_requests"], pa["balance_compute"]) <= 1.5,
    }
    return out


def tune(name: str, args: argparse.Namespace) -> dict:
    trace = load_trace(name)
    grid = {}
    for wp in (0.5, 1.0, 2.0, 4.0, 8.0):
        picker = WeightedPicker.from_config(PickerConfig(wp, 1.0))
        grid[f"prefix={wp}:queue=1"] = simulate(trace, picker, args.instances, args.capacity, True)
    return grid


# --- decision latency -------------------------------------------------------------------------


def fill_index(index: PrefixIndex, trace: list[dict], n: int, blocks: int) -> list[list[int]]:
    """Spread trace requests over n instances until `blocks` (instance, block) entries exist."""
    held: list[set[int]] = [set() for _ in range(n)]
    prompts, count = [], 0
    for i, req in enumerate(trace):
        if count >= blocks:
            break
        mine = held[i % n]
        new = [h for h in req["hash_ids"] if h not in mine]
        mine.update(new[: blocks - count])
        count += len(new[: blocks - count])
        prompts.append(req["hash_ids"])
    for i, hs in enumerate(held):
        index.heartbeat(f"inst-{i}", {"role": "prefill"})
        assert index.resync(f"inst-{i}", sorted(hs), seq=0)
    return prompts


def time_decisions(index: PrefixIndex, prompts: list[list[int]], samples: int, ping=None) -> dict:
    picker = WeightedPicker.from_config(PickerConfig())
    views = [InstanceView(i, queued_tokens=17 * len(i)) for i in index.instances()]
    lat, pings = [], []
    for k in range(samples):
        hashes = prompts[k % len(prompts)]
        t0 = time.perf_counter()
        request = RoutingRequest(len(hashes) * BLOCK_TOKENS, len(hashes), index.match(hashes))
        picker.pick(request, views)
        lat.append(time.perf_counter() - t0)
        if ping is not None:
            t0 = time.perf_counter()
            ping()
            pings.append(time.perf_counter() - t0)
    out = {"samples": samples, "p50_us": round(percentile(lat, 0.5) * 1e6, 1),
           "p99_us": round(percentile(lat, 0.99) * 1e6, 1)}
    if pings:
        out["ping_p50_us"] = round(percentile(pings, 0.5) * 1e6, 1)
        out["ping_p99_us"] = round(percentile(pings, 0.99) * 1e6, 1)
    return out


def start_redis(workdir: str) -> tuple[subprocess.Popen | None, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        return None, "redis-server not installed (apt-get install -y redis-server)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
                             "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.02)
    proc.kill()
    return None, "redis-server did not start"


def long_prompts(index: PrefixIndex, blocks: int, count: int = 8) -> list[list[int]]:
    """Prompts of `blocks` blocks, each held whole by one extra instance (no early exit)."""
    rng = random.Random(blocks)
    prompts = [[rng.getrandbits(63) for _ in range(blocks)] for _ in range(count)]
    iid = f"long-{blocks}"
    index.heartbeat(iid, {"role": "prefill"})
    assert index.resync(iid, [h for p in prompts for h in p], seq=0)
    return prompts


def measure(index: PrefixIndex, trace: list[dict], args: argparse.Namespace, ping=None) -> dict:
    prompts = fill_index(index, trace, args.instances, args.index_blocks)
    out = {"indexed_blocks": sum(index.num_blocks(i) for i in index.instances()),
           "mean_prompt_blocks": round(sum(map(len, prompts)) / len(prompts), 1)}
    time_decisions(index, prompts, 200, ping)  # warm up
    out.update(time_decisions(index, prompts, args.samples, ping))
    out["by_prompt_blocks"] = {
        n: time_decisions(index, long_prompts(index, n), 300, ping) for n in LONG_PROMPT_BLOCKS}
    return out


def decision_latency(args: argparse.Namespace) -> dict:
    trace = load_trace("conversation")
    out = {"memory": measure(MemoryPrefixIndex(ttl_s=1e9), trace, args)}
    try:
        from redis.utils import HIREDIS_AVAILABLE

        from pdserve.router.redis_index import RedisPrefixIndex
    except ImportError:
        out["redis"] = {"skipped": "the redis package is not installed (pip install redis)"}
        return out
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(tmp)
        if proc is None:
            out["redis"] = {"skipped": url}
            return out
        try:
            index = RedisPrefixIndex(url, ttl_s=3600, socket_timeout_s=1.0)
            out["redis"] = measure(index, trace, args, index.ping)
            out["redis"]["errors"] = index.errors
            out["redis"]["reply_parser"] = "hiredis" if HIREDIS_AVAILABLE else "python"
            index.close()
        finally:
            proc.kill()
            proc.wait()
    mem, red = out["memory"], out["redis"]
    out["targets"] = {"memory_p99_le_1ms": mem["p99_us"] <= 1000}
    if "p99_us" in red:
        ok = red["p99_us"] <= red["ping_p99_us"] + 1000
        out["targets"]["redis_p99_le_ping_p99_plus_1ms"] = ok
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=5000, help="LRU blocks per instance")
    ap.add_argument("--traces", nargs="+", default=list(TRACES), choices=TRACES)
    ap.add_argument("--index-blocks", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=5000, help="timed decisions per backend")
    ap.add_argument("--tune", action="store_true", help="also print the weight grid")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    config = PickerConfig()
    result = {
        "command": " ".join(["python", *sys.argv]),
        "config": {"instances": args.instances, "capacity_blocks_per_instance": args.capacity,
                   "block_tokens": BLOCK_TOKENS, "prefill_tokens_per_s": PREFILL_TPS,
                   "output_token_s": OUTPUT_TOKEN_S, "picker": asdict(config)},
        "traces": {name: replay(name, args, config) for name in args.traces},
    }
    if args.tune:
        result["tuning_conversation"] = tune("conversation", args)
    result["decision_latency"] = decision_latency(args)
    result["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
