"""The router's instance registry: which prefill/decode instances are live, and their load.

Two feeds fill one table keyed by instance id (the address while the id is unknown):
- dynamic instances call `Router.Heartbeat(Load)` (the services' `--router` flag): `observe()`;
- static instances (addresses given on the router's command line) are polled with `GetLoad`
  by a `StaticPoller` thread every `poll_interval_s`.

An instance not seen within `ttl_s` is ignored for routing; `mark_down()` (an RPC to it failed)
takes it out at once, until an observation that started after the failure brings it back.
The table holds at most `max_instances` instances: a new heartbeating one is refused
(`RegistryFull`) until one there has been silent for `forget_after_s`. Static instances (the
operator's list) always get in; one that answers with a new id (a restart) replaces its old
entry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.scorers.base import InstanceView
from pdserve.router.wire_names import check_address, check_instance_id

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
ROLES = {"prefill": "prefill", "decode": "decode", "colocated": "both", "both": "both"}


@dataclass(frozen=True)
class Instance:
    """One registered instance: what scorers see, plus what the request flow needs."""

    view: InstanceView
    connector: str = ""
    block_size: int = 0  # 0: not reported
    last_seen: float = 0.0
    static: bool = False
    down_since: float | None = None
    load: common_pb2.Load = field(default_factory=common_pb2.Load, compare=False, repr=False)

    @property
    def id(self) -> str:
        return self.view.id

    @property
    def address(self) -> str:
        return self.view.address

    def to_load(self) -> common_pb2.Load:
        """The latest Load, with the id, address and role the router uses."""
        load = common_pb2.Load()
        load.CopyFrom(self.load)
        load.instance_id, load.address = self.view.id, self.view.address
        load.role = "colocated" if self.view.role == "both" else self.view.role
        return load


# A Load's counts, read by routing and disaggregation rules, and its totals, summed into the
# gateway's /metrics (negative ones are refused).
COUNTS = ("waiting_requests", "running_requests", "waiting_tokens", "free_blocks",
          "total_blocks", "leased_requests", "prefix_queries", "prefix_hits", "kv_bytes_received",
          "kv_loads_failed", "cached_blocks", "spec_drafts", "spec_draft_tokens",
          "spec_accepted_tokens")


def instance_from_load(load: common_pb2.Load, *, address: str = "", role: str = "",
                       seen_at: float = 0.0, static: bool = False) -> Instance:
    """Build an Instance from a Load; `address`/`role` (a static instance's) take precedence.

    Raises ValueError naming the field for a Load the router cannot use."""
    address = check_address(address or load.address)
    if load.block_size and (load.block_size > 1024 or load.block_size & (load.block_size - 1)):
        raise ValueError(f"block_size: expected a power of two up to 1024, got "
                         f"{load.block_size}")
    role = role or load.role
    if role not in ROLES:
        raise ValueError(f"role: expected prefill, decode or colocated, got {role!r}")
    for name in COUNTS:
        if getattr(load, name) < 0:
            raise ValueError(f"{name}: must be >= 0, got {getattr(load, name)}")
    if not 0 <= load.kv_transfer_seconds < float("inf"):  # NaN fails both
        raise ValueError(f"kv_transfer_seconds: must be finite and >= 0, got "
                         f"{load.kv_transfer_seconds}")
    if len(load.connector) > 16:
        raise ValueError(f"connector: expected a connector's name, got {load.connector[:40]!r}")
    kept = common_pb2.Load()  # NOTE: a copy without unknown fields, which nothing reads
    kept.CopyFrom(load)
    kept.DiscardUnknownFields()
    view = InstanceView(
        id=check_instance_id(load.instance_id or address), role=ROLES[role], address=address,
        queued_requests=load.waiting_requests, queued_tokens=load.waiting_tokens,
        running_requests=load.running_requests, free_blocks=load.free_blocks,
        total_blocks=load.total_blocks)
    return Instance(view, load.connector, max(0, load.block_size), seen_at, static, load=kept)


class RegistryFull(Exception):
    """A new instance was refused: the registry already holds `max_instances` live ones."""


class Registry:
    """Thread-safe table of instances; `clock` is monotonic seconds (injectable for tests)."""

    def __init__(self, ttl_s: float = 3.0, forget_after_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_forget: Callable[[str], None] = lambda address: None,
                 max_instances: int = 1024):
        """`on_forget(address)`: no instance the table keeps has `address` any more (the
        router closes its channel there: a restarted instance has a new port)."""
        if ttl_s <= 0 or forget_after_s < ttl_s:
            raise ValueError(f"registry: need 0 < ttl_s <= forget_after_s, got ttl_s={ttl_s}, "
                             f"forget_after_s={forget_after_s}")
        if max_instances < 1:
            raise ValueError(f"max_instances: must be >= 1, got {max_instances}")
        self.ttl_s = ttl_s
        self.forget_after_s = forget_after_s
        self.max_instances = max_instances
        self.clock = clock
        self.on_forget = on_forget
        self._lock = threading.Lock()
        self._table: dict[str, Instance] = {}

    def observe(self, load: common_pb2.Load, *, address: str = "", role: str = "",
                seen_at: float | None = None, static: bool = False) -> Instance:
        """Record a heartbeat or poll answer; `seen_at` is when the observation started (an
        answer to a poll sent before a `mark_down` does not bring the instance back)."""
        now = self.clock()
        seen_at = now if seen_at is None else seen_at
        inst = instance_from_load(load, address=address, role=role, seen_at=seen_at,
                                  static=static)
        with self._lock:
            old = self._table.get(inst.id)
            if old is None and not static:
                self._make_room(now)
            if old is not None:
                inst = replace(inst, static=inst.static or old.static,
                               last_seen=max(old.last_seen, seen_at))
                if old.static and not static:
                    # A heartbeat of an instance the router polls: the operator's address and
                    # role stand, and only a poll (the router reaching it) clears a down mark.
                    inst = replace(inst, down_since=old.down_since, view=replace(
                        inst.view, address=old.address, role=old.view.role))
                elif old.down_since is not None and seen_at < old.down_since:
                    inst = replace(inst, down_since=old.down_since)
            self._table[inst.id] = inst
            self._forget_lapsed(now)
        return inst

    def mark_down(self, instance_id: str) -> bool:
        """An RPC to this instance failed: skip it until it answers again. True when it was
        not marked down already."""
        with self._lock:
            inst = self._table.get(instance_id)
            if inst is not None:
                self._table[instance_id] = replace(inst, down_since=self.clock())
            return inst is not None and inst.down_since is None

    def is_live(self, inst: Instance, now: float) -> bool:
        return inst.down_since is None and now - inst.last_seen <= self.ttl_s

    def live(self, role: str | None = None) -> list[Instance]:
        """Live instances (sorted by id) that can serve `role` ("prefill"/"decode"/None: any)."""
        now = self.clock()
        with self._lock:
            found = [i for i in self._table.values() if self.is_live(i, now)]
        if role is not None:
            found = [i for i in found if i.view.role in (role, "both")]
        return sorted(found, key=lambda i: i.id)

    def get(self, instance_id: str) -> Instance | None:
        with self._lock:
            return self._table.get(instance_id)

    def all(self) -> list[Instance]:
        """Every instance in the table, live or not."""
        with self._lock:
            return sorted(self._table.values(), key=lambda i: i.id)

    def block_size(self) -> int:
        """The block size the live instances report (the first one's), else the default."""
        for inst in self.live():
            if inst.block_size > 0:
                return inst.block_size
        return DEFAULT_BLOCK_SIZE

    def _make_room(self, now: float) -> None:
        """Room for one more heartbeating instance, or RegistryFull (caller holds the lock)."""
        self._forget_lapsed(now)
        if len(self._table) >= self.max_instances:
            raise RegistryFull(f"the router already tracks {self.max_instances} instances "
                               f"(--max-instances)")

    def forget(self, instance_id: str) -> None:
        """Drop an instance now (a static address answered with a new id: it restarted)."""
        with self._lock:
            inst = self._table.pop(instance_id, None)
            if inst is not None and all(i.address != inst.address
                                        for i in self._table.values()):
                self.on_forget(inst.address)

    def _forget_lapsed(self, now: float) -> None:
        lapsed = [i for i, inst in self._table.items()
                  if not inst.static and now - inst.last_seen > self.forget_after_s]
        gone = {self._table.pop(iid).address for iid in lapsed}
        for address in gone - {inst.address for inst in self._table.values()}:
            self.on_forget(address)


class StaticPoller:
    """Polls static instances' `GetLoad` on a thread, feeding the registry.

    `targets` are (address, role) pairs; `stub_for(address, role)` gives a stub over a cached
    channel (ChannelPool.stub).
    Polls run concurrently (futures), so a dead instance does not delay the others.
    """

    def __init__(self, registry: Registry, targets: Sequence[tuple[str, str]],
                 stub_for: Callable[[str, str], Any], poll_interval_s: float = 0.5,
                 timeout_s: float = 1.0):
        for address, role in targets:
            if role not in ("prefill", "decode"):
                raise ValueError(f"static instance {address}: role must be prefill or decode")
        self.registry = registry
        self.targets = list(targets)
        self.stub_for = stub_for
        self.poll_interval_s = poll_interval_s
        self.timeout_s = min(timeout_s, max(poll_interval_s, 0.2) * 2)
        self._ids: dict[str, str] = {}  # address -> instance id of its last answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-poller", daemon=True)

    def start(self) -> StaticPoller:
        if self.targets:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s + 1)

    def poll_once(self) -> None:
        """Ask every target once and wait (bounded) for the answers."""
        pending: list[tuple[str, str, float, Future]] = []
        for address, role in self.targets:
            stub = self.stub_for(address, role)
            started = self.registry.clock()
            pending.append((address, role, started,
                            stub.GetLoad.future(common_pb2.LoadRequest(), timeout=self.timeout_s)))
        for address, role, started, fut in pending:
            try:
                load = fut.result()
            except grpc.RpcError as e:
                # NOTE: a slow answer is left to the TTL; only a refused connection is "down".
                if e.code() == grpc.StatusCode.UNAVAILABLE and address in self._ids \
                        and self.registry.mark_down(self._ids[address]):
                    log.warning("instance %s (%s) does not answer polls: not routed to until "
                                "it does (%s)", self._ids[address], address, e.details())
                continue
            try:
                inst = self.registry.observe(load, address=address, role=role,
                                             seen_at=started, static=True)
            except ValueError:
                continue
            old = self._ids.get(address)
            if old is not None and old != inst.id:
                self.registry.forget(old)
            self._ids[address] = inst.id

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.poll_interval_s)
