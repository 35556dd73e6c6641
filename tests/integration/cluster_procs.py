"""Start pdserve server processes for tests, wait until they are healthy, stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.ports import pick_free_port
from pdserve.services.auth import CHANNEL_OPTIONS


def free_port() -> int:
    return pick_free_port("127.0.0.1")


class ServerProcess:
    """`python -m pdserve.cli ARGS` with a known port; stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, *args: str, port: int | None = None, startup_timeout: float = 90,
                 wait: bool = True):
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *args, "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if wait:
            self.wait_healthy(startup_timeout)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # Short reconnect backoff: probes made before it listened must not delay the next.
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(self.address, CHANNEL_OPTIONS))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.proc.stdout.read()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server on {self.address} not healthy in {timeout}s")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 15 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class GatewayProcess:
    """`python -m pdserve.gateway.server` (= `pdserve serve`) on a free port."""

    def __init__(self, *args: str, startup_timeout: float = 90):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.gateway.server", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        # NOTE: one thread reads every line; waiting on the pipe with select beside a buffered
        # readline misses a line that arrived in the same read as the one before it.
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = self._wait_listening(startup_timeout)
        self._wait_healthy(startup_timeout)

    def _wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in list(self.log):
                if "listening on " in line:
                    return line.rsplit("listening on ", 1)[1].strip()
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("gateway did not start:\n" + "".join(self.log[-30:]))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("gateway not healthy:\n" + "".join(self.log[-30:]))

    def stop(self) -> None:
        stop_process(self.proc)


def all_free(cluster) -> bool:
    """Every instance of `cluster` has all its KV blocks free and no lease held."""
    from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2_grpc

    for child in cluster.instances:
        stub = (engine_pb2_grpc.PrefillStub if child.role == "prefill"
                else engine_pb2_grpc.DecodeStub)(grpc.insecure_channel(child.address))
        load = stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
        if load.free_blocks != load.total_blocks or load.leased_requests:
            return False
    return True


def wait_for(predicate, timeout: float = 15, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def prefill_and_decode(model_dir, connector: str, kv_bytes: int = 8 << 20
                       ) -> tuple[ServerProcess, ServerProcess]:
    """A prefill (5 s leases) and a decode process of `model_dir` over `connector`, started
    side by side (each loads on its own core where there are two)."""
    common = ["--model", str(model_dir), "--connector", connector,
              "--kv-cache-memory-bytes", str(kv_bytes)]
    pair = (ServerProcess("prefill", *common, "--kv-lease-s", "5", wait=False),
            ServerProcess("decode", *common, wait=False))
    try:
        for server in pair:
            server.wait_healthy(90)
    except Exception:
        for server in pair:
            server.stop()
        raise
    return pair
