"""KV events on the wire: what an engine instance tells the prefix index about its cache.

An instance drains its block pool's events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`)
into a `KVEventBatch` and numbers batches 0, 1, 2, ... A batch with seq 0 announces a fresh
instance (first start or restart: its cache is empty). A receiver that sees a gap, or a seq that
went backwards, has missed something and must resync that instance from a full snapshot.

`to_dict`/`from_dict` give a JSON-able form. Block hashes are ints in [0, 2^63), which JSON
carries exactly in Python (and in any int64-aware decoder). A batch holds at most
MAX_BATCH_OPS operations (a hash stored or removed, or a clear), so that applying one is a
bounded piece of work for any index (one Redis script); `KVEventSequencer.batches` splits
what an engine recorded into as many batches as that takes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.router.wire_names import check_instance_id, check_medium

_HASH_LIMIT = 1 << 63
MAX_BATCH_OPS = 4096  # hashes stored or removed, and clears, in one batch


@dataclass(frozen=True)
class KVEventBatch:
    """One instance's KV events since its previous batch.

    `medium` says which tier the stored blocks live in ("gpu", "cpu", ...); the prefix index
    records it next to each block.
    """

    instance_id: str
    seq: int
    events: tuple[KVEvent, ...]
    timestamp: float = field(default_factory=time.time)
    medium: str = "gpu"

    def __post_init__(self) -> None:
        check_instance_id(self.instance_id)
        if not isinstance(self.seq, int) or self.seq < 0:
            raise ValueError(f"seq: must be an int >= 0, got {self.seq!r}")
        check_medium(self.medium)
        object.__setattr__(self, "events", tuple(self.events))
        check_batch_ops(count_ops(self.events))

    def to_dict(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "seq": self.seq,
            "timestamp": self.timestamp,
            "medium": self.medium,
            "events": [event_to_dict(e) for e in self.events],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventBatch:
        """Inverse of `to_dict`; raises ValueError naming the bad field."""
        try:
            events = data["events"]
            return cls(
                instance_id=data["instance_id"],
                seq=data["seq"],
                events=tuple(event_from_dict(e) for e in events),
                timestamp=float(data.get("timestamp", 0.0)),
                medium=str(data.get("medium", "gpu")),
            )
        except KeyError as e:
            raise ValueError(f"{e.args[0]}: missing from KV event batch") from None


def event_to_dict(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {"type": "stored", "block_hashes": list(event.block_hashes),
                "parent_hash": event.parent_hash, "num_tokens": event.num_tokens}
    if isinstance(event, BlockRemoved):
        return {"type": "removed", "block_hashes": list(event.block_hashes)}
    if isinstance(event, AllBlocksCleared):
        return {"type": "all_cleared"}
    raise TypeError(f"not a KV event: {event!r}")


def event_from_dict(data: dict[str, Any]) -> KVEvent:
    kind = data.get("type")
    if kind == "stored":
        parent = data.get("parent_hash")
        return BlockStored(check_hashes(data.get("block_hashes")),
                           None if parent is None else check_hash(parent, "parent_hash"),
                           check_num_tokens(int(data.get("num_tokens", 0))))
    if kind == "removed":
        return BlockRemoved(check_hashes(data.get("block_hashes")))
    if kind == "all_cleared":
        return AllBlocksCleared()
    raise ValueError(f"events.type: unknown KV event type {kind!r}")


def check_hash(value: Any, name: str) -> int:
    """`value`, or ValueError naming `name` when it is not a block hash."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _HASH_LIMIT:
        raise ValueError(f"{name}: block hash must be an int in [0, 2^63), got {value!r}")
    return value


def check_hashes(values: Any) -> tuple[int, ...]:
    """`values` as a tuple, or ValueError when one is not a block hash."""
    if not isinstance(values, list | tuple):
        raise ValueError("block_hashes: must be a list of ints")
    return tuple(check_hash(v, "block_hashes") for v in values)


def count_ops(events: Iterable[KVEvent]) -> int:
    """Hashes stored or removed, plus clears: the work of applying `events`."""
    return sum(1 if isinstance(e, AllBlocksCleared) else len(e.block_hashes) for e in events)


def check_batch_ops(n: int) -> None:
    """ValueError naming `events` when a batch would hold more than MAX_BATCH_OPS ops."""
    if n > MAX_BATCH_OPS:
        raise ValueError(f"events: {n} block hashes and clears in one batch, at most "
                         f"{MAX_BATCH_OPS} (split it into more batches)")


def split_events(events: Iterable[KVEvent], limit: int | None = None) -> list[list[KVEvent]]:
    """`events` in order, in groups of at most `limit` (MAX_BATCH_OPS) ops, at least one
    group. A stored or removed run longer than a group's room is cut: each stored part chains
    from the last hash of the part before it and carries its own blocks' tokens."""
    limit = limit or MAX_BATCH_OPS
    groups: list[list[KVEvent]] = [[]]
    room = limit
    for event in events:
        size = count_ops([event])
        done = 0
        while True:
            if room == 0 and size:
                groups.append([])
                room = limit
            take = min(room, size - done)
            whole = isinstance(event, AllBlocksCleared) or (done == 0 and take == size)
            groups[-1].append(event if whole else _part(event, done, done + take))
            room -= take
            done += take
            if done == size:
                break
    return groups


def _part(event: BlockStored | BlockRemoved, start: int, end: int) -> KVEvent:
    """The hashes [start, end) of a stored or removed event, as an event of its own."""
    hashes = event.block_hashes[start:end]
    if isinstance(event, BlockRemoved):
        return BlockRemoved(hashes)
    per_block = event.num_tokens // len(event.block_hashes)
    tokens = (event.num_tokens - per_block * start if end == len(event.block_hashes)
              else per_block * (end - start))
    parent = event.parent_hash if start == 0 else event.block_hashes[start - 1]
    return BlockStored(hashes, parent, tokens)


def check_num_tokens(value: int) -> int:
    if value < 0:
        raise ValueError(f"num_tokens: must be >= 0, got {value}")
    return value


class KVEventSequencer:
    """Numbers an instance's batches: the first is seq 0 (fresh instance), then +1 each."""

    def __init__(self, instance_id: str, medium: str = "gpu"):
        self.instance_id = instance_id
        self.medium = medium
        self.next_seq = 0

    def batch(self, events: Iterable[KVEvent]) -> KVEventBatch:
        """One batch of `events` (at most MAX_BATCH_OPS ops: ValueError otherwise)."""
        batch = KVEventBatch(self.instance_id, self.next_seq, tuple(events), time.time(),
                             self.medium)
        self.next_seq += 1
        return batch

    def batches(self, events: Iterable[KVEvent]) -> list[KVEventBatch]:
        """`events` in consecutive batches of at most MAX_BATCH_OPS ops (one if they fit,
        empty or not)."""
        return [self.batch(group) for group in split_events(events)]
