"""Bootstrap shared by every pdserve gRPC server: health service, reflection, clean stop."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.services.auth import AuthInterceptor, Credentials
from pdserve.services.call_slots import SHORT_CALL_THREADS, CallSlots, CallSlotsInterceptor
from pdserve.services.malformed import MalformedRequestInterceptor


class GrpcServer:
    """A threaded gRPC server with health and reflection, bound to host:port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_long_calls: int = 32,
                 long_methods: Iterable[str] = (), credentials: Credentials | None = None):
        """`credentials`: who may call which method (auth.py); None: anyone.
        `long_methods` ("/package.Service/Method"): calls that hold a thread for long (streams,
        generations); at most `max_long_calls` of them run at once, and SHORT_CALL_THREADS
        more threads serve every other call (call_slots.py)."""
        interceptors = [AuthInterceptor(credentials)] if credentials is not None else []
        interceptors.append(MalformedRequestInterceptor())
        self.long_calls = CallSlots(max_long_calls)
        interceptors.append(CallSlotsInterceptor(self.long_calls, long_methods))
        max_workers = max_long_calls + SHORT_CALL_THREADS
        self.server = grpc.server(ThreadPoolExecutor(max_workers=max_workers),
                                  interceptors=interceptors,
                                  options=[("grpc.so_reuseport", 0)])
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        tls = credentials.tls if credentials is not None else None
        self.port = (self.server.add_secure_port(f"{host}:{port}", tls.server_credentials())
                     if tls is not None else self.server.add_insecure_port(f"{host}:{port}"))
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.address = f"{host}:{self.port}"
        self._services: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self._done = threading.Event()
        self._exit_code = 0

    def add(self, register: Callable, servicer, service_names: Iterable[str]) -> None:
        """Add a servicer (`register` is the generated add_XServicer_to_server)."""
        register(servicer, self.server)
        self._services.extend(service_names)

    def start(self) -> None:
        reflection.enable_server_reflection(self._services, self.server)
        self.server.start()
        for name in self._services:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1)

    def fail(self) -> None:
        """Report NOT_SERVING on every service and end `serve_until_signal` with exit code 1:
        the process can no longer serve, and its supervisor should restart it."""
        for name in self._services + [""]:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._exit_code = 1
        self._done.set()

    def serve_until_signal(self, on_stop: Callable[[], None] = lambda: None,
                           ready: Callable[[], None] = lambda: None) -> int:
        """Block until SIGTERM or SIGINT (exit code 0) or `fail()` (1), then stop the server
        and run `on_stop`; returns the exit code. `ready` runs once the signals are caught
        (where a server says it listens: a supervisor may stop it from then on)."""
        signalled: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            # NOTE: a handler must take no lock (Event.set does): it runs between two
            # bytecodes of the main thread, which may hold that very lock.
            signal.signal(sig, lambda signum, _: signalled.append(signum))
        ready()
        # The handler cannot wake the wait, so it polls: a stop starts within 0.1 s.
        while not signalled and not self._done.wait(0.1):
            pass
        self.stop()
        on_stop()
        return self._exit_code


def service_name(module, name: str) -> str:
    """Full name of a proto service, e.g. 'pdserve.v1.Prefill'."""
    return module.DESCRIPTOR.services_by_name[name].full_name


def load_message(instance_id: str, role: str, address: str, stats, connector: str,
                 block_size: int) -> common_pb2.Load:
    return common_pb2.Load(
        instance_id=instance_id, role=role, address=address,
        waiting_requests=stats.waiting_requests, running_requests=stats.running_requests,
        waiting_tokens=stats.waiting_tokens, free_blocks=stats.free_blocks,
        total_blocks=stats.total_blocks, leased_requests=stats.leased_requests,
        connector=connector, block_size=block_size, prefix_queries=stats.prefix_queries,
        prefix_hits=stats.prefix_hits, kv_bytes_received=stats.kv_bytes_received,
        kv_transfer_seconds=stats.kv_transfer_seconds, kv_loads_failed=stats.kv_loads_failed,
        cached_blocks=stats.cached_blocks, speculative=stats.speculative,
        spec_drafts=stats.drafts, spec_draft_tokens=stats.draft_tokens,
        spec_accepted_tokens=stats.accepted_tokens)
