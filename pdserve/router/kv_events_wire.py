"""KV event batches to and from their protobuf form (router.proto)."""

from __future__ import annotations

from pdserve.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.proto.pdserve.v1 import router_pb2
from pdserve.router.kv_events import (KVEventBatch, check_batch_ops, check_hash, check_hashes,
                                      check_num_tokens)


def event_to_proto(event: KVEvent) -> router_pb2.KVEvent:
    if isinstance(event, BlockStored):
        stored = router_pb2.BlockStored(block_hashes=event.block_hashes,
                                        num_tokens=event.num_tokens)
        if event.parent_hash is not None:
            stored.parent_hash = event.parent_hash
        return router_pb2.KVEvent(stored=stored)
    if isinstance(event, BlockRemoved):
        return router_pb2.KVEvent(removed=router_pb2.BlockRemoved(
            block_hashes=event.block_hashes))
    return router_pb2.KVEvent(cleared=router_pb2.AllBlocksCleared())


def event_from_proto(msg: router_pb2.KVEvent) -> KVEvent:
    kind = msg.WhichOneof("kind")
    if kind == "stored":
        s = msg.stored
        return BlockStored(check_hashes(tuple(s.block_hashes)),
                           check_hash(s.parent_hash, "parent_hash") if s.HasField("parent_hash")
                           else None, check_num_tokens(s.num_tokens))
    if kind == "removed":
        return BlockRemoved(check_hashes(tuple(msg.removed.block_hashes)))
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError("events: a KVEvent has no kind set")


def batch_to_proto(batch: KVEventBatch) -> router_pb2.KVEventBatch:
    return router_pb2.KVEventBatch(
        instance_id=batch.instance_id, seq=batch.seq, timestamp=batch.timestamp,
        medium=batch.medium, events=[event_to_proto(e) for e in batch.events])


def batch_from_proto(msg: router_pb2.KVEventBatch) -> KVEventBatch:
    """Raises ValueError naming the field on a malformed batch (block hashes in [0, 2^63),
    as the JSON form's; at most MAX_BATCH_OPS of them, counted before any is converted)."""
    check_batch_ops(sum(1 if e.WhichOneof("kind") == "cleared" else
                        len(e.stored.block_hashes) + len(e.removed.block_hashes)
                        for e in msg.events))
    return KVEventBatch(msg.instance_id, msg.seq,
                        tuple(event_from_proto(e) for e in msg.events), msg.timestamp,
                        msg.medium or "gpu")
