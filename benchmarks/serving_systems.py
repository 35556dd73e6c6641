"""The systems `serving.py` measures: each started (and later stopped) on this machine,
serving the OpenAI-format API on a loopback URL. See serving.py for what each one is.
"""

from __future__ import annotations

import os
import signal
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL_NAME = "bench"  # the served model name every system answers to
STARTUP_S = 300


class Skip(Exception):
    """A system that cannot run here; the reason is reported."""


class Proc:
    """A server process whose output goes to a log file."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None):
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1",
                                              **(env or {})})

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_line(self, marker: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if marker in line:
                    return line
            if self.proc.poll() is not None:
                raise Skip(f"exited with code {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.2)
        raise Skip(f"no {marker!r} within {timeout:.0f}s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def wait_healthy(url: str, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise Skip(f"exited with code {proc.proc.returncode}:\n{proc.tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise Skip(f"{url} not healthy within {timeout:.0f}s:\n{proc.tail()}")


def gateway(args, logs: Path, name: str, extra: list[str]) -> tuple[str, Proc]:
    cmd = [sys.executable, "-m", "pdserve.gateway.server", "--model", args.model,
           "--served-model-name", MODEL_NAME, "--port", "0", "--max-concurrency", "4096",
           "--log-level", "warning", *extra]
    proc = Proc(cmd, logs / f"{name}.log")
    line = proc.wait_line("listening on ", STARTUP_S)
    url = line.rsplit("listening on ", 1)[1].strip()
    wait_healthy(url, proc, STARTUP_S)
    return url, proc


def engine_flags(args) -> list[str]:
    flags = ["--dtype", args.dtype, *shlex.split(args.engine_args)]
    if args.kv_cache_memory_bytes:
        flags += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    return flags


def start_colocated(args, logs: Path):
    url, proc = gateway(args, logs, "colocated", engine_flags(args))
    return url, proc.stop


def start_1p1d(args, logs: Path):
    from pdserve.cluster import Cluster, ClusterError, ClusterSpec

    flags = ("--dtype", args.dtype, *shlex.split(args.engine_args))
    spec = ClusterSpec(model=args.model, num_prefill=1, num_decode=1, connector=args.connector,
                       grpc_port=0, disagg_threshold=args.disagg_threshold,
                       kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                       startup_timeout_s=STARTUP_S, log_dir=str(logs / "1p1d"),
                       instance_args=flags)
    cluster = Cluster(spec)
    try:
        cluster.start()
    except ClusterError as e:
        raise Skip(f"`pdserve up` did not start: {e}") from e
    try:
        url, proc = gateway(args, logs, "1p1d-gateway", ["--router", cluster.router_address])
    except BaseException:
        cluster.stop()
        raise

    def stop():
        proc.stop()
        cluster.stop()
    return url, stop


def start_vllm(args, logs: Path):
    if not args.vllm_python:
        raise Skip("no --vllm-python PATH given (a venv with vLLM's CPU build)")
    model = args.vllm_model or args.model
    if not Path(model).is_dir():
        raise Skip(f"vLLM's CPU build needs a Hugging Face directory; {model!r} is not one "
                   "(give --vllm-model DIR)")
    port = free_port()
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", args.dtype, "--max-model-len", "2048", *shlex.split(args.vllm_args)]
    proc = Proc(cmd, logs / "vllm.log", env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, args.vllm_startup_s)
    except BaseException:
        proc.stop()
        raise
    return url, proc.stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SYSTEMS = {"colocated": start_colocated, "1p1d": start_1p1d, "vllm": start_vllm}
