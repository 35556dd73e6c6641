"""gRPC channels to instances, one per address, with short reconnect backoff.

NOTE: gRPC's default reconnect backoff grows to two minutes; an instance restarted on the same
address must be reachable again within a poll or two, so the backoff is capped at one second.
gRPC's `grpc.min_reconnect_backoff_ms` is left alone: it is also the shortest time a connection
attempt may take (20 s by default), and a short one made a loaded instance that answers its
handshake late unreachable for good. No keepalive pings: servers refuse frequent ones, and
every call here has a deadline.
"""

from __future__ import annotations

import threading

import grpc

from pdserve.proto.pdserve.v1 import engine_pb2_grpc
from pdserve.services.auth import Credentials, internal_channel

CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ChannelPool:
    """Cached channels by address, and stubs over them; every call carries the cluster
    secret of `credentials` (when there is one)."""

    def __init__(self, credentials: Credentials = Credentials()):
        self.credentials = credentials
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = internal_channel(address, self.credentials, CHANNEL_OPTIONS)
                self._channels[address] = channel
            return channel

    def prefill(self, address: str) -> engine_pb2_grpc.PrefillStub:
        return engine_pb2_grpc.PrefillStub(self.get(address))

    def decode(self, address: str) -> engine_pb2_grpc.DecodeStub:
        return engine_pb2_grpc.DecodeStub(self.get(address))

    def pooling(self, address: str) -> engine_pb2_grpc.PoolingStub:
        return engine_pb2_grpc.PoolingStub(self.get(address))

    def addresses(self) -> set[str]:
        """The addresses with an open channel."""
        with self._lock:
            return set(self._channels)

    def discard(self, address: str) -> None:
        """Close the channel to `address`, if there is one (a later `get` opens a new one)."""
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
