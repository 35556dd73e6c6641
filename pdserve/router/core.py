"""What every request flow of the router shares (`RouterCore`): config, registry, planner,
channels, tokenizer, and the calls a flow makes besides its own (probes, aborts, releases)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2
from pdserve.router.channels import ChannelPool
from pdserve.router.registry import Instance, Registry
from pdserve.router.routing import Planner, RouterConfig

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
    # Release/Abort calls that nobody waits for (a dropped gRPC future would cancel itself).
    background: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="router-bg"))
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)

    def encode(self, text: str) -> list[int]:
        """Same call as the engine's input processor, so both see the same ids."""
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text))

    def forget_on_prefill(self, address: str, request_id: str) -> None:
        """Best effort, in the background: abort a prefill and release its lease."""
        stub, timeout = self.channels.prefill(address), self.config.control_timeout_s

        def run():
            for name, call, msg in (
                    ("abort", stub.Abort, common_pb2.AbortRequest(request_id=request_id)),
                    ("release", stub.Release, engine_pb2.ReleaseRequest(request_id=request_id))):
                try:
                    call(msg, timeout=timeout)
                except grpc.RpcError as e:
                    logger.info("%s of %s at %s: %s", name, request_id, address, e.code().name)

        try:
            self.background.submit(run)
        except RuntimeError:  # shutting down: the lease expires by itself
            pass

    def is_down(self, instance: Instance, role: str = "decode") -> bool:
        """True when an instance does not answer a probe (GetLoad, never behind a step)."""
        stubs = {"decode": self.channels.decode, "prefill": self.channels.prefill}
        try:
            stubs[role](instance.address).GetLoad(
                common_pb2.LoadRequest(), timeout=self.config.control_timeout_s)
        except grpc.RpcError:
            return True
        return False

    def close(self) -> None:
        self.background.shutdown(wait=False, cancel_futures=True)
        self.channels.close()
