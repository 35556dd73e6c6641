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
    secret of `credentials` (when there is one).

    NOTE: grpc crashes the process when a stub is built over a closed channel, so stubs are
    built, and channels closed, under one lock: build stubs with `stub` (or `prefill`,
    `decode`, `pooling`), not over a channel from `get` whose address may be discarded."""

    def __init__(self, credentials: Credentials = Credentials(),
                 max_channels: int | None = None):
        """`max_channels`: keep at most this many open, closing the least recently used
        (None: no bound, for addresses the caller bounds itself)."""
        self.credentials = credentials
        self.max_channels = max_channels
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def get(self, address: str) -> grpc.Channel:
        """The channel to `address`, opened if needed (for an address never discarded)."""
        with self._lock:
            return self._channel(address)

    def stub(self, address: str, service: str):
        """A stub of `service` ("prefill", "decode", "pooling") over `address`'s channel."""
        with self._lock:
            return STUBS[service](self._channel(address))

    def prefill(self, address: str) -> engine_pb2_grpc.PrefillStub:
        return self.stub(address, "prefill")

    def decode(self, address: str) -> engine_pb2_grpc.DecodeStub:
        return self.stub(address, "decode")

    def pooling(self, address: str) -> engine_pb2_grpc.PoolingStub:
        return self.stub(address, "pooling")

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

    def _channel(self, address: str) -> grpc.Channel:  # under the lock
        channel = self._channels.pop(address, None)
        if channel is None:
            channel = internal_channel(address, self.credentials, CHANNEL_OPTIONS)
            while self.max_channels and len(self._channels) >= self.max_channels:
                self._channels.pop(next(iter(self._channels))).close()
        self._channels[address] = channel  # the most recently used last
        return channel


STUBS = {"prefill": engine_pb2_grpc.PrefillStub, "decode": engine_pb2_grpc.DecodeStub,
         "pooling": engine_pb2_grpc.PoolingStub}
