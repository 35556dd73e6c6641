"""The fault matrix: a 2P2D cluster under concurrent mixed requests while a fault strikes.

After every case: each request either completed with the healthy run's greedy tokens or got a
clear error (never a hang: every call has a deadline and every thread is joined), and every
surviving instance goes idle with no used, leased or waiting block; no /dev/shm segment of a
dead process is left. A representative subset runs by default; the whole matrix runs with
PDSERVE_FAULT_MATRIX=1 (and a 64-stream load test with default settings runs in both).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from cluster_procs import wait_for
from redis_fixture import RedisServer, _find_or_install_redis_server

from pdserve import LLM, SamplingParams
from pdserve.cluster import SHM_DIR, Cluster, ClusterSpec
from pdserve.kv_transfer.shm_segment import owner_alive, pid_namespace
from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

FULL = os.environ.get("PDSERVE_FAULT_MATRIX") == "1"
full_only = pytest.mark.skipif(not FULL, reason="part of the full fault matrix: "
                               "PDSERVE_FAULT_MATRIX=1 runs it")
KV_BYTES = 16 << 20
DEADLINE_S = 90.0
# (prompt, max_tokens): prompts of 20-600 tokens, outputs of 16-300, all greedy.
WORKLOAD = [([(7 * i + 13 * j) % 9000 + 100 for j in range(n)], m) for i, (n, m) in enumerate(
    [(20, 300), (600, 64), (45, 200), (300, 16), (120, 250), (33, 120), (480, 40), (64, 300)])]
CLEAR_ERRORS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


@pytest.fixture(scope="module")
def healthy(tiny_model_dir):
    """The healthy run's tokens for every request of the workload (colocated engine)."""
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=KV_BYTES)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in WORKLOAD],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                         for _, m in WORKLOAD], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def start(tiny_model_dir, tmp_path, connector: str, **extra) -> Cluster:
    """A 2P2D cluster, started by `with`."""
    spec = ClusterSpec(model=str(tiny_model_dir), connector=connector, num_prefill=2,
                       num_decode=2, grpc_port=0, disagg_threshold=16,
                       kv_cache_memory_bytes=KV_BYTES, startup_timeout_s=120,
                       instance_args=("--kv-lease-s", "5"), log_dir=str(tmp_path), **extra)
    return Cluster(spec)


class Traffic:
    """The workload sent at once, one thread per request; outcomes collected."""

    def __init__(self, cluster: Cluster, workload=WORKLOAD):
        self.stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
        self.calls: list = [None] * len(workload)
        self.outcomes: list = [None] * len(workload)
        self.first_token = [threading.Event() for _ in workload]
        self.threads = [threading.Thread(target=self._run, args=(i, p, m), daemon=True)
                        for i, (p, m) in enumerate(workload)]
        for t in self.threads:
            t.start()

    def _run(self, i: int, prompt: list[int], max_tokens: int) -> None:
        request = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True))
        tokens = []
        try:
            self.calls[i] = self.stub.Generate(request, timeout=DEADLINE_S)
            for msg in self.calls[i]:
                tokens += msg.token_ids
                self.first_token[i].set()
            self.outcomes[i] = ("ok", tokens)
        except grpc.RpcError as e:
            self.outcomes[i] = (e.code(), e.details())
        finally:
            self.first_token[i].set()

    def wait_first_tokens(self, count: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while sum(e.is_set() for e in self.first_token) < count:
            assert time.monotonic() < deadline, "no first tokens"
            time.sleep(0.01)

    def finish(self) -> list:
        for t in self.threads:
            t.join(DEADLINE_S + 30)
            assert not t.is_alive(), "a request hung past its deadline"
        return self.outcomes


def check_outcomes(outcomes, healthy, cancelled=frozenset()) -> int:
    """Every request completed correctly or failed clearly; returns how many completed."""
    done = 0
    for i, (status, value) in enumerate(outcomes):
        if i in cancelled:
            assert status in ("ok", grpc.StatusCode.CANCELLED), (i, status, value)
        elif status == "ok":
            assert value == healthy[i], f"request {i}: tokens differ from the healthy run"
            done += 1
        else:
            assert status in CLEAR_ERRORS and value, (i, status, value)
    return done


def check_quiescent(cluster: Cluster) -> None:
    """Surviving instances idle with nothing used, leased or waiting; no stale segment."""
    alive = [c for c in cluster.instances if c.proc.poll() is None]

    def idle() -> bool:
        for child in alive:
            stub = (engine_pb2_grpc.PrefillStub if child.role == "prefill"
                    else engine_pb2_grpc.DecodeStub)(grpc.insecure_channel(child.address))
            load = stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
            if (load.free_blocks != load.total_blocks or load.leased_requests
                    or load.waiting_requests or load.running_requests):
                return False
        return True

    assert wait_for(idle, timeout=30, interval=0.25), "an instance kept blocks or requests"
    cluster.dead()  # the supervisor reclaims what a killed instance left
    ns = pid_namespace()
    for name in os.listdir(SHM_DIR):
        parts = name.removeprefix("pdserve-kv-").split("-")
        if name.startswith("pdserve-kv-") and int(parts[0]) == ns:
            assert owner_alive(int(parts[1]), int(parts[2]), ns), f"stale segment {name}"


def kill(cluster: Cluster, name: str) -> None:
    cluster.child(name).proc.send_signal(signal.SIGKILL)
    cluster.child(name).proc.wait(10)


# ------------------------------------------------------------------------------ the cases

def test_decode_killed_mid_stream_migrates(tiny_model_dir, tmp_path, healthy):
    with start(tiny_model_dir, tmp_path, "tcp") as cluster:
        traffic = Traffic(cluster)
        traffic.wait_first_tokens(6)
        kill(cluster, "decode-0")
        assert check_outcomes(traffic.finish(), healthy) == len(WORKLOAD)
        check_quiescent(cluster)


def test_clients_disconnecting_leave_nothing_behind(tiny_model_dir, tmp_path, healthy):
    with start(tiny_model_dir, tmp_path, "shm") as cluster:
        traffic = Traffic(cluster)
        traffic.wait_first_tokens(4)
        cancelled = {0, 2, 4, 7}
        for i in cancelled:
            if traffic.calls[i] is not None:
                traffic.calls[i].cancel()
        check_outcomes(traffic.finish(), healthy, cancelled)
        check_quiescent(cluster)


@full_only
@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_prefill_killed_while_prefilling(tiny_model_dir, tmp_path, healthy, connector):
    with start(tiny_model_dir, tmp_path, connector) as cluster:
        traffic = Traffic(cluster)
        kill(cluster, "prefill-0")  # at once: some requests are prefilling on it
        assert check_outcomes(traffic.finish(), healthy) == len(WORKLOAD)
        check_quiescent(cluster)


@full_only
def test_prefill_killed_holding_leases(tiny_model_dir, tmp_path, healthy):
    with start(tiny_model_dir, tmp_path, "tcp") as cluster:
        traffic = Traffic(cluster)
        traffic.wait_first_tokens(2)  # prefills done, leases held until the decodes pull
        kill(cluster, "prefill-1")
        assert check_outcomes(traffic.finish(), healthy) == len(WORKLOAD)
        check_quiescent(cluster)


@full_only
def test_all_prefills_killed(tiny_model_dir, tmp_path, healthy):
    with start(tiny_model_dir, tmp_path, "shm") as cluster:
        traffic = Traffic(cluster)
        kill(cluster, "prefill-0")
        kill(cluster, "prefill-1")
        assert check_outcomes(traffic.finish(), healthy) == len(WORKLOAD)
        check_quiescent(cluster)


@full_only
def test_redis_down_and_back(tiny_model_dir, tmp_path, healthy):
    redis = RedisServer(_find_or_install_redis_server(), tmp_path)
    redis.start()
    try:
        with start(tiny_model_dir, tmp_path, "tcp", redis_url=redis.url) as cluster:
            traffic = Traffic(cluster)
            redis.stop()
            traffic.wait_first_tokens(4)
            redis.start()
            assert check_outcomes(traffic.finish(), healthy) == len(WORKLOAD)
            check_quiescent(cluster)
    finally:
        redis.stop()


def test_64_concurrent_streams_with_default_settings(tiny_model_dir, tmp_path):
    """Load with the router's and instances' defaults: nothing fails, nothing is lost."""
    workload = [([(11 * i + j) % 8000 + 100 for j in range(24 + i % 40)], 24 + i % 17)
                for i in range(64)]
    spec = ClusterSpec(model=str(tiny_model_dir), connector="shm", grpc_port=0,
                       kv_cache_memory_bytes=KV_BYTES, startup_timeout_s=120,
                       log_dir=str(tmp_path))
    with Cluster(spec) as cluster:
        outcomes = Traffic(cluster, workload).finish()
        for (status, value), (_, max_tokens) in zip(outcomes, workload):
            assert status == "ok", (status, value)
            assert len(value) == max_tokens
        check_quiescent(cluster)
