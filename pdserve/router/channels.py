"""gRPC channels to instances, one per address, with short reconnect backoff
(`CHANNEL_OPTIONS`). No keepalive pings: servers refuse frequent ones, and every call here has
a deadline.
"""

from __future__ import annotations

import threading
import time

import grpc

from pdserve.proto.pdserve.v1 import engine_pb2_grpc
from pdserve.services.auth import CHANNEL_OPTIONS, Credentials, internal_channel

# A channel dropped from the pool (evicted, or its address discarded) closes this long after,
# so that calls already made on it (a Release, a routed request) finish; at most MAX_RETIRED
# wait, the oldest closing first.
CLOSE_AFTER_S = 10.0
MAX_RETIRED = 256


class ChannelPool:
    """Cached channels by address, and stubs over them; every call carries the cluster
    secret of `credentials` (when there is one).

    NOTE: grpc crashes the process when a stub is built over a closed channel, so stubs are
    built, and channels closed, under one lock, and only over channels still in the pool:
    build stubs with `stub` (or `prefill`, `decode`, `pooling`), not over a channel from `get`
    whose address may be discarded."""

    def __init__(self, credentials: Credentials = Credentials(),
                 max_channels: int | None = None):
        """`max_channels`: keep at most this many open, closing the least recently used
        (None: no bound, for addresses the caller bounds itself)."""
        self.credentials = credentials
        self.max_channels = max_channels
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._retired: list[tuple[float, grpc.Channel]] = []  # (when it closes, channel)

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
        """Drop the channel to `address`, if there is one (a later `get` opens a new one); it
        closes CLOSE_AFTER_S later."""
        with self._lock:
            channel = self._channels.pop(address, None)
            if channel is not None:
                self._retire(channel)

    def close(self) -> None:
        with self._lock:
            channels = [*self._channels.values(), *(ch for _, ch in self._retired)]
            self._channels, self._retired = {}, []
            for channel in channels:
                channel.close()

    def _channel(self, address: str) -> grpc.Channel:  # under the lock
        self._close_retired(time.monotonic())
        channel = self._channels.pop(address, None)
        if channel is None:
            channel = internal_channel(address, self.credentials, CHANNEL_OPTIONS)
            while self.max_channels and len(self._channels) >= self.max_channels:
                self._retire(self._channels.pop(next(iter(self._channels))))
        self._channels[address] = channel  # the most recently used last
        return channel

    def _retire(self, channel: grpc.Channel) -> None:  # under the lock
        self._retired.append((time.monotonic() + CLOSE_AFTER_S, channel))
        while len(self._retired) > MAX_RETIRED:
            self._retired.pop(0)[1].close()

    def _close_retired(self, now: float) -> None:  # under the lock
        while self._retired and self._retired[0][0] <= now:
            self._retired.pop(0)[1].close()


STUBS = {"prefill": engine_pb2_grpc.PrefillStub, "decode": engine_pb2_grpc.DecodeStub,
         "pooling": engine_pb2_grpc.PoolingStub}
