"""A local cluster: a router, N prefill and M decode instances as separate processes on this
host (what `pdserve up` runs, cluster_cli.py; tests start one the same way).

Each server is its own OS process in its own process group (so a terminal's Ctrl-C reaches
only `pdserve up`, which then stops them in order) with the parent-death signal set, so that
nothing outlives `pdserve up` even when it is killed. Output goes to one log file per process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cpu_budget import available_cores, format_cores, split_cores
from pdserve.logging_setup import FORMATS, LEVELS
from pdserve.models.loader import DEFAULT_MODEL
from pdserve.parent_watch import PARENT_ENV
from pdserve.ports import pick_free_port
from pdserve.proto.pdserve.v1 import router_pb2, router_pb2_grpc
from pdserve.services.auth import (API_KEY_ENV, CHANNEL_OPTIONS, SECRET_ENV, Credentials,
                                   internal_channel)

CPU_SHARING = ("turns", "split", "shared")  # ClusterSpec.cpu_sharing
# `pdserve up`'s --disagg-min-running where prefill and decode compute on the same cores: a
# decode instance running fewer requests prefills prompts itself. Measured on 2 cores: a decode
# row costs 12-20% more in a step of 7 decodes alone than beside a prompt chunk, and a step of
# 12 decodes or more runs in lanes (benchmarks/results/disagg_vs_colocated.md, last section).
SHARED_CORES_DISAGG_MIN_RUNNING = 12
SHM_DIR = "/dev/shm"  # where shm instances keep their KV segments (ShmTransport's default)


def _reclaim_shm() -> None:
    """Remove the KV segments of dead instances (never a live one's)."""
    from pdserve.kv_transfer.shm_segment import sweep_stale_segments

    sweep_stale_segments(SHM_DIR)

_PR_SET_PDEATHSIG = 1


class ClusterError(RuntimeError):
    """A server did not come up (it exited, or was not healthy in time)."""


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. Ports: the router's as given (0: a free one); instances get free ones."""

    model: str = DEFAULT_MODEL
    num_prefill: int = 1
    num_decode: int = 1
    connector: str = "shm"
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    disagg_threshold: int = 64
    disagg_min_running: int = 0  # the router's --disagg-min-running
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    redis_url: str | None = None
    redis_key_prefix: str = "pdserve"  # clusters sharing one Redis need different ones
    startup_timeout_s: float = 180.0
    log_dir: str | None = None  # default: a fresh temporary directory
    instance_args: tuple[str, ...] = ()  # extra flags for every instance (e.g. --kv-lease-s 5)
    router_args: tuple[str, ...] = ()  # extra flags for the router
    gateway_args: tuple[str, ...] = ()  # extra flags for the HTTP gateway (`serve --router`)
    # How engine processes share these cores (None: every core this process may use):
    # "turns": each runs on all of them, one step at a time (cpu_turns.py); "split": disjoint
    # shares (cpu_budget.split_cores); "shared": each on all of them, no turns.
    cpu_cores: tuple[int, ...] | None = None
    cpu_sharing: str = "turns"
    http_port: int | None = None  # the OpenAI-format gateway in front of the router (None: none)
    api_key: str | None = None  # the gateway's Bearer key (in its environment, never argv)
    log_level: str = "info"  # every process's --log-level and --log-format
    log_format: str = "text"
    # The internal plane's secret, given to every child in its environment (never argv);
    # None: internal calls are not authenticated. `pdserve up` always makes one.
    cluster_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.api_key is not None and ("," in self.api_key or not self.api_key.strip()):
            raise ValueError("api_key: one key, without commas (it reaches the gateway in "
                             "$PDSERVE_API_KEY, a comma-separated list)")
        if self.disagg_threshold < 0 or self.disagg_min_running < 0:
            raise ValueError(f"disagg_threshold and disagg_min_running must be >= 0, got "
                             f"{self.disagg_threshold} and {self.disagg_min_running}")
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"num_prefill must be >= 0 and num_decode >= 1, got "
                             f"{self.num_prefill} and {self.num_decode}")
        if self.connector not in ("shm", "tcp", "nixl"):
            raise ValueError(f"connector: expected shm, tcp or nixl, got {self.connector!r}")
        if self.cpu_sharing not in CPU_SHARING:
            raise ValueError(f"cpu_sharing: expected one of {', '.join(CPU_SHARING)}, got "
                             f"{self.cpu_sharing!r}")
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be positive")
        if self.log_level not in LEVELS or self.log_format not in FORMATS:
            raise ValueError(f"log_level / log_format: expected one of {LEVELS} / {FORMATS}, "
                             f"got {self.log_level!r} / {self.log_format!r}")


@dataclass
class Child:
    """One server process."""

    name: str  # "router", "prefill-0", "decode-1", ...
    role: str
    address: str
    proc: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)  # what started it (a restart reuses it)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # its own, beyond the rest
    restarts: int = 0

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def free_port(host: str) -> int:
    """A port for a child that binds `host` (checked there: a wildcard host checks every
    address) to listen on (see ports.pick_free_port)."""
    return pick_free_port(host)


def _dial_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


def _die_with_parent() -> Callable[[], None]:
    """preexec_fn: the child gets SIGTERM when the process that started it dies, including
    when it died between the fork and this call (then the child's parent is no longer it).
    SIGTERM goes back to its default action first: until exec, the child still has this
    process's Python handler, which would swallow the signal."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: nothing to load after it
    parent = os.getpid()

    def arm() -> None:
        libc.signal(signal.SIGTERM, 0)  # SIG_DFL
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


class Cluster:
    """Starts, checks and stops the processes of a spec; a context manager."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self._swept: set[tuple[str, int]] = set()  # (child, restarts) exits whose shm is swept
        # Set to True (from a signal handler too: a plain attribute takes no lock) to give up
        # waiting for startup.
        self.interrupted = False
        host = spec.host
        self.router_address = (f"{_dial_host(host)}:"
                               f"{spec.grpc_port or free_port(host)}")

    @property
    def instances(self) -> list[Child]:
        return [c for c in self.children if c.role in ("prefill", "decode")]

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    # ------------------------------------------------------------------ start
    def start(self) -> Cluster:
        """Start every process and wait until all are healthy and registered with the router;
        on failure stop everything and raise ClusterError."""
        try:
            self._spawn_all()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn_all(self) -> None:
        s = self.spec
        dial = _dial_host(s.host)
        planned = [(f"prefill-{i}", "prefill") for i in range(s.num_prefill)]
        planned += [(f"decode-{i}", "decode") for i in range(s.num_decode)]
        addresses = {name: f"{dial}:{free_port(s.host)}" for name, _ in planned}
        router_cmd = ["router", "--model", s.model, "--host", s.host,
                      "--grpc-port", self.router_address.rsplit(":", 1)[1],
                      "--disagg-threshold", str(s.disagg_threshold),
                      "--disagg-min-running", str(s.disagg_min_running), *s.router_args]
        for name, role in planned:
            router_cmd += [f"--{role}", addresses[name]]
        if s.redis_url:
            router_cmd += ["--redis-url", s.redis_url, "--redis-key-prefix", s.redis_key_prefix]
        self._spawn("router", "router", self.router_address, router_cmd)
        if s.http_port is not None:
            self.http_address = f"{dial}:{s.http_port or free_port(s.host)}"
            gateway_cmd = ["serve", "--router", self.router_address, "--model", s.model,
                           "--host", s.host, "--port", self.http_address.rsplit(":", 1)[1],
                           *s.gateway_args]
            self._spawn("gateway", "gateway", self.http_address, gateway_cmd,
                        {API_KEY_ENV: s.api_key} if s.api_key else {})
        for (name, role), cpu_flags in zip(planned, self._cpu_flags(len(planned))):
            cmd = [role, "--model", s.model, "--host", s.host,
                   "--port", addresses[name].rsplit(":", 1)[1], "--connector", s.connector,
                   "--router", self.router_address, "--instance-id", name, *s.instance_args,
                   *cpu_flags]
            if s.kv_cache_memory_bytes:
                cmd += ["--kv-cache-memory-bytes", str(s.kv_cache_memory_bytes)]
            if s.kv_cache_memory_fraction:
                cmd += ["--kv-cache-memory-fraction", str(s.kv_cache_memory_fraction)]
            if s.redis_url:
                cmd += ["--redis-url", s.redis_url, "--redis-key-prefix", s.redis_key_prefix]
            self._spawn(name, role, addresses[name], cmd)

    def _cpu_flags(self, num_engines: int) -> list[list[str]]:
        """Each engine process's CPU flags for the spec's cpu_sharing."""
        s = self.spec
        pool = list(s.cpu_cores) if s.cpu_cores else available_cores()
        if s.cpu_sharing == "split":
            return [["--cpu-cores", format_cores(share)]
                    for share in split_cores(num_engines, pool)]
        flags = ["--cpu-cores", format_cores(pool)]
        if s.cpu_sharing == "turns" and num_engines > 1:
            flags += ["--cpu-turns", str(self.log_dir / "cpu-turns")]
        return [flags] * num_engines

    def _spawn(self, name: str, role: str, address: str, args: list[str],
               env: dict[str, str] | None = None) -> None:
        log_path = self.log_dir / f"{name}.log"
        args = [*args, "--log-level", self.spec.log_level, "--log-format", self.spec.log_format]
        argv = [sys.executable, "-m", "pdserve.cli", *args]
        env = env or {}
        self.children.append(Child(name, role, address, self._popen(argv, log_path, "wb", env),
                                   log_path, argv, env))

    def _popen(self, argv: list[str], log_path: Path, mode: str,
               env: dict[str, str]) -> subprocess.Popen:
        if threading.current_thread() is not threading.main_thread():
            # Linux ties the parent-death signal to the thread that forked, not the process:
            # children started here would get SIGTERM when this thread ends.
            raise ClusterError("start and restart a Cluster from the main thread")
        # NOTE: preexec_fn runs between fork and exec; it only calls a libc function loaded
        # beforehand, so the usual hazard with threads (a lock held at fork) does not apply.
        with open(log_path, mode) as log:
            return subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent(),  # noqa: PLW1509
                env={**self._child_env(), **env})

    def restart(self, child: Child) -> None:
        """Start an exited child again, as before (same arguments and port; its log goes
        on): an instance reloads its model and is routable once the router hears from it."""
        if child.proc.poll() is None:
            raise ValueError(f"{child.name} is still running")
        child.proc = self._popen(child.argv, child.log_path, "ab", child.env)
        child.restarts += 1

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
        if self.spec.cluster_secret:
            env[SECRET_ENV] = self.spec.cluster_secret
        return env

    @property
    def credentials(self) -> Credentials:
        """What a client inside the cluster presents (the cluster secret, if any)."""
        return Credentials(self.spec.cluster_secret)

    def wait_ready(self) -> None:
        """Bounded wait: every process SERVING, then every instance listed by the router."""
        deadline = time.monotonic() + self.spec.startup_timeout_s
        for child in self.children:
            if child.role == "gateway":
                self._wait_http(child, deadline)
            else:
                self._wait_healthy(child, deadline)
        want = {c.name for c in self.instances}
        with internal_channel(self.router_address, self.credentials, CHANNEL_OPTIONS) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            seen: set[str] = set()
            while time.monotonic() < deadline:
                self._check_alive()
                try:
                    listed = stub.ListInstances(router_pb2.ListInstancesRequest(), timeout=1)
                    seen = {i.instance_id for i in listed.instances}
                except grpc.RpcError:
                    pass
                if want <= seen:
                    return
                time.sleep(0.1)
        raise ClusterError(f"the router did not register {sorted(want - seen)} within "
                           f"{self.spec.startup_timeout_s:.0f}s (logs in {self.log_dir})")

    def _wait_healthy(self, child: Child, deadline: float) -> None:
        # Short backoff: a probe made before the server listened must not delay the next.
        with grpc.insecure_channel(child.address, options=CHANNEL_OPTIONS) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self._check_alive()
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise ClusterError(f"{child.name} ({child.address}) was not healthy within "
                           f"{self.spec.startup_timeout_s:.0f}s; last lines of "
                           f"{child.log_path}:\n{child.tail()}")

    def _wait_http(self, child: Child, deadline: float) -> None:
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"http://{child.address}/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise ClusterError(f"{child.name} (http://{child.address}) did not answer /health "
                           f"within {self.spec.startup_timeout_s:.0f}s; last lines of "
                           f"{child.log_path}:\n{child.tail()}")

    def _check_alive(self) -> None:
        if self.interrupted:
            raise ClusterError("interrupted while starting")
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                raise ClusterError(f"{child.name} exited with code {code}; last lines of "
                                   f"{child.log_path}:\n{child.tail()}")

    # ------------------------------------------------------------------ run and stop
    def dead(self) -> list[Child]:
        """Children that exited; the shm segments of any that crashed are reclaimed (only
        segments whose owner is dead are touched), once per exit."""
        dead = [c for c in self.children if c.proc.poll() is not None]
        exits = {(c.name, c.restarts) for c in dead}
        if exits - self._swept and self.spec.connector == "shm":
            _reclaim_shm()
        self._swept |= exits
        return dead

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, wait up to `grace_s`, SIGKILL what is left."""
        for child in reversed(self.children):  # instances first, the router last
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for child in self.children:
            _signal_group(child.proc, signal.SIGKILL)  # stragglers and any grandchildren
            child.proc.wait()
        if self.spec.connector == "shm":
            _reclaim_shm()  # what a killed instance could not remove itself

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> str:
        lines = [f"router     {self.router_address}  (gRPC)"]
        if self.spec.http_port is not None:
            lines.insert(0, f"http       http://{self.http_address}/v1  (OpenAI API)")
        lines += [f"{c.name:<10} {c.address}  ({c.role}, {self.spec.connector})"
                  for c in self.instances]
        lines.append(f"logs       {self.log_dir}")
        if self.spec.cluster_secret:
            lines.append("internal   calls need the cluster secret (given to the children in "
                         f"${SECRET_ENV})")
        return "\n".join(lines)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.returncode is not None:  # reaped: its pid, the group's id, may be another's now
        return
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the child's pid
    except (ProcessLookupError, PermissionError):
        pass

