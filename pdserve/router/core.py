"""What every request flow of the router shares (`RouterCore`): config, registry, planner,
channels, tokenizer, and the calls a flow makes besides its own (probes, aborts, releases)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2
from pdserve.router.channels import ChannelPool
from pdserve.router.registry import Instance, Registry
from pdserve.router.routing import Planner, RouterConfig
from pdserve.router.stream_watch import StreamWatch

logger = logging.getLogger(__name__)
Code = grpc.StatusCode
# Prefill failures that take the instance out of routing (anything else but INVALID_ARGUMENT
# is still retried elsewhere, without the mark).
DOWN_CODES = {Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.INTERNAL, Code.UNKNOWN}


@dataclass
class RouterCore:
    """What every request flow shares: config, registry, planner, channels, tokenizer."""

    config: RouterConfig
    registry: Registry
    planner: Planner
    channels: ChannelPool
    tokenizer: Any
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    # Abort/Release calls that nobody waits for (a dropped gRPC future would cancel itself).
    _in_flight: set = field(default_factory=set)
    _unwaited_lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False
    stream_watch: StreamWatch = field(init=False)

    def __post_init__(self) -> None:
        # A decode stream silent as long as a prefill may run unprobed has its D probed.
        self.stream_watch = StreamWatch(self.config.prefill_timeout_s, self.is_down)

    def encode(self, text: str) -> list[int]:
        """Same call as the engine's input processor, so both see the same ids."""
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text))

    def forget_on_prefill(self, address: str, request_id: str) -> None:
        """Best effort, without waiting: abort a prefill, then release its lease. Calls are
        chained futures, so one frozen prefill instance holds up no other's releases."""
        stub, timeout = self.channels.prefill(address), self.config.control_timeout_s

        def release() -> None:
            with contextlib.suppress(ValueError):  # the channel closed: the lease expires
                self._unwaited("release", stub.Release.future(
                    engine_pb2.ReleaseRequest(request_id=request_id), timeout=timeout),
                    request_id, address)

        with contextlib.suppress(ValueError):
            self._unwaited("abort", stub.Abort.future(
                common_pb2.AbortRequest(request_id=request_id), timeout=timeout),
                request_id, address, then=release)

    def _unwaited(self, name: str, future: Any, request_id: str, address: str,
                  then: Callable[[], None] | None = None) -> None:
        """Keep `future` referenced until it is done (a gRPC future dropped early cancels
        its call), log a failure, then start `then`."""
        with self._unwaited_lock:
            self._in_flight.add(future)

        def done(f: Any) -> None:
            with self._unwaited_lock:
                self._in_flight.discard(f)
            if not f.cancelled() and f.exception() is not None:
                logger.info("%s of %s at %s: %s", name, request_id, address,
                            f.exception().code().name)
            if then is not None and not self._closed:
                then()

        future.add_done_callback(done)

    def is_down(self, instance: Instance, role: str = "decode") -> bool:
        """True when an instance does not answer a probe (GetLoad, never behind a step)."""
        stubs = {"decode": self.channels.decode, "prefill": self.channels.prefill}
        try:
            stubs[role](instance.address).GetLoad(
                common_pb2.LoadRequest(), timeout=self.config.control_timeout_s)
        except (grpc.RpcError, ValueError):  # ValueError: its channel was just closed
            return True
        return False

    def close(self) -> None:
        self._closed = True
        self.stream_watch.close()
        self.channels.close()
