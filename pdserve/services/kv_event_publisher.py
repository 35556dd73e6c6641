"""Publishes an engine's prefix-cache events to the prefix index, batched and numbered.

Every `interval_s` the events the block pool recorded are sent as one `KVEventBatch` (several
when they name more than MAX_BATCH_OPS hashes); when the index answers that it cannot apply a
batch (a gap, a restart on either side, Redis flushed), the publisher sends a full snapshot of
the cached hashes instead. Sinks: the router's in-memory index over gRPC, or Redis directly
(several routers then share it). An idle engine still sends an empty batch every `check_s`, so
that an index that lost its state (a router or Redis restarted, Redis flushed) learns it and
gets the snapshot without waiting for the engine's next event.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import grpc

from pdserve.engine.engine_loop import EngineLoop
from pdserve.proto.pdserve.v1 import router_pb2, router_pb2_grpc
from pdserve.router.kv_events import KVEventBatch, KVEventSequencer
from pdserve.router.kv_events_wire import batch_to_proto

logger = logging.getLogger(__name__)
# While the sink is away each try snapshots the whole cache on the engine's thread: back off.
MAX_RETRY_S = 5.0
CHECK_S = 1.0  # an idle engine's empty batch, asking the index whether it still follows


class EventSink(Protocol):
    def apply(self, batch: KVEventBatch) -> bool: ...

    def resync(self, instance_id: str, block_hashes: list[int], seq: int,
               medium: str = "gpu") -> bool: ...


class RouterSink:
    """The router's in-memory prefix index, over gRPC."""

    def __init__(self, channel: grpc.Channel, timeout_s: float = 2.0):
        self.stub = router_pb2_grpc.RouterStub(channel)
        self.timeout_s = timeout_s

    def apply(self, batch: KVEventBatch) -> bool:
        try:
            return self.stub.PublishKVEvents(batch_to_proto(batch), timeout=self.timeout_s).applied
        except grpc.RpcError:
            return False

    def resync(self, instance_id, block_hashes, seq, medium="gpu") -> bool:
        snapshot = router_pb2.KVStateSnapshot(instance_id=instance_id, seq=seq, medium=medium,
                                              block_hashes=block_hashes)
        try:
            return self.stub.ResyncKVState(snapshot, timeout=self.timeout_s).applied
        except grpc.RpcError:
            return False


class KVEventPublisher:
    """A thread moving the engine's KV events into a sink."""

    def __init__(self, loop: EngineLoop, sink: EventSink, instance_id: str,
                 interval_s: float = 0.1, medium: str = "gpu", check_s: float = CHECK_S):
        self.loop = loop
        self.sink = sink
        self.sequencer = KVEventSequencer(instance_id, medium)
        self.interval_s = interval_s
        self.check_s = check_s
        self._sent_at = float("-inf")
        self.in_sync = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")

    def start(self) -> KVEventPublisher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def publish_once(self) -> None:
        events = self.loop.take_kv_events()
        if not events and self.in_sync and time.monotonic() - self._sent_at < self.check_s:
            return
        batches = self.sequencer.batches(events)  # more than one past MAX_BATCH_OPS
        self._sent_at = time.monotonic()
        self.in_sync = all(self.sink.apply(batch) for batch in batches)  # stops at a refusal
        if not self.in_sync:  # the snapshot holds every event taken: it stands for them all
            snapshot = self.loop.kv_snapshot()
            self.in_sync = self.sink.resync(self.sequencer.instance_id, snapshot,
                                            batches[-1].seq, self.sequencer.medium)

    def _run(self) -> None:
        wait = self.interval_s
        while not self._stop.wait(wait):
            try:
                self.publish_once()
            except Exception:  # noqa: BLE001 - keep publishing; the index resyncs later
                logger.exception("publishing KV events failed")
                self.in_sync = False
            wait = self.interval_s if self.in_sync else min(2 * wait, MAX_RETRY_S)
