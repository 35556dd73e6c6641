"""The engine's KV connector: what the scheduler asks about remote KV, and who moves it.

Split by side, as the engine is:
- scheduler side: `make_handle` (producer: describe a finished prefill's blocks for a reader),
  `start_load` / `take_finished_loads` (consumer: pull a prompt's missing blocks, report when
  done, successfully or not);
- worker side: `allocate_kv_cache` (the cache lives in memory the transport serves from) and
  the byte moves, delegated to a `KVTransport` on a background thread.

`KVConnector` itself is the null object: no remote KV, the cache is plain memory.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.transport import (KVLayout, KVTransport, binding_digest,
                                          zeroed_kv_cache)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVHandle:
    """Where a prefilled prompt's KV blocks are and how to read them."""

    request_id: str
    engine_id: str
    descriptor: dict[str, Any]  # the transport's descriptor: kind, address, layout
    block_ids: tuple[int, ...]  # producer blocks holding tokens [0, num_tokens)
    block_hashes: tuple[int, ...]  # hashes of its full blocks (block_hash.py)
    num_tokens: int
    lease_expires_at: float = 0.0  # producer's wall clock (time.time())
    release_address: str = ""  # producer service to tell when reading is done
    lease_token: str = field(default="", repr=False)  # the producer's grant (KVTransport.grant)

    @property
    def connector(self) -> str:
        return self.descriptor.get("kind", "")

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "engine_id": self.engine_id,
                "descriptor": self.descriptor, "block_ids": list(self.block_ids),
                "block_hashes": list(self.block_hashes), "num_tokens": self.num_tokens,
                "lease_expires_at": self.lease_expires_at,
                "release_address": self.release_address, "lease_token": self.lease_token}

    def check(self, num_prompt_tokens: int, block_size: int) -> None:
        """Raise ValueError naming the field unless this handle can describe the KV of a
        `num_prompt_tokens`-token prompt in blocks of `block_size` (it comes off the wire)."""
        if not 1 <= self.num_tokens <= num_prompt_tokens:
            raise ValueError(f"handle.num_tokens: {self.num_tokens} is outside "
                             f"[1, {num_prompt_tokens}] (the prompt's length)")
        need = -(-self.num_tokens // block_size)
        if len(self.block_ids) != need:
            raise ValueError(f"handle.block_ids: {len(self.block_ids)} ids for "
                             f"{self.num_tokens} tokens in blocks of {block_size} (want {need})")
        layout = self.descriptor.get("layout")
        num_blocks = layout.get("num_blocks") if isinstance(layout, dict) else None
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError("handle.descriptor_json: no valid layout.num_blocks")
        if isinstance(layout, dict) and layout.get("block_size") != block_size:
            raise ValueError(f"handle.descriptor_json: layout.block_size "
                             f"{layout.get('block_size')!r} differs from this engine's "
                             f"{block_size}")
        if any(not 0 <= b < num_blocks for b in self.block_ids):
            raise ValueError(f"handle.block_ids: ids must be in [0, {num_blocks})")
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError("handle.block_ids: repeated block id")
        if len(self.block_hashes) != self.num_tokens // block_size:
            raise ValueError(f"handle.block_hashes: {len(self.block_hashes)} hashes for "
                             f"{self.num_tokens // block_size} full blocks")
        if not math.isfinite(self.lease_expires_at):
            raise ValueError("handle.lease_expires_at: must be finite")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVHandle:
        try:
            return cls(str(d["request_id"]), str(d["engine_id"]), dict(d["descriptor"]),
                       tuple(int(b) for b in d["block_ids"]),
                       tuple(int(h) for h in d.get("block_hashes", ())), int(d["num_tokens"]),
                       float(d.get("lease_expires_at", 0.0)), str(d.get("release_address", "")),
                       str(d.get("lease_token", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"kv_transfer_params: malformed KV handle ({e})") from e


@dataclass
class LoadResult:
    request_id: str
    ok: bool
    error: str = ""
    num_bytes: int = 0
    seconds: float = 0.0
    handle: KVHandle | None = field(default=None, repr=False)


class KVConnector:
    """No remote KV: the null connector every engine has unless given another."""

    kind = "none"

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype,
                          device: str) -> torch.Tensor:
        """Zeroed cache of `shape` (layers, 2, blocks, block_size, kv_heads, head_dim)."""
        return zeroed_kv_cache(shape, dtype, device)

    def make_handle(self, request_id: str, block_ids: list[int], block_hashes: list[int],
                    num_tokens: int, lease_expires_at: float) -> KVHandle | None:
        return None

    def revoke(self, request_id: str) -> None:
        """A lease ended (released or expired): its blocks are no longer served."""

    def start_load(self, request_id: str, handle: KVHandle, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        raise KVTransferError("this engine has no KV connector to load remote blocks with")

    def skip_load(self, handle: KVHandle) -> None:
        """Every block `handle` describes is cached here already: nothing is read, and the
        producer may end its lease."""

    def take_finished_loads(self) -> list[LoadResult]:
        return []

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` (on a worker thread) each time a load finishes, so that a
        loop waiting only for loads can sleep until one does."""

    def close(self) -> None:
        pass


class TransportConnector(KVConnector):
    """A connector over one `KVTransport` (shm, tcp or nixl), loading on a worker thread.

    `on_loaded(handle)` runs on the worker thread after every load attempt, and when there is
    nothing to load, so the producer can release its lease (the decode service passes its
    Release call). It runs once the
    engine has the result: the producer answers a release between its own engine steps, and
    a decode that waited for that answer waited up to a whole prefill step (20-40 ms on
    average, from logs of `benchmarks/disagg_vs_colocated.py`) before its first step.
    """

    def __init__(self, transport: KVTransport,
                 on_loaded: Callable[[KVHandle], None] = lambda handle: None):
        self.transport = transport
        self.kind = transport.kind
        self.on_loaded = on_loaded
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-load")
        self._done: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self._load_listeners: list[Callable[[], None]] = []
        self._descriptor: dict[str, Any] | None = None

    def allocate_kv_cache(self, shape, dtype, device) -> torch.Tensor:
        L, _, blocks, bs, heads, dim = shape
        dtype_name = str(dtype).removeprefix("torch.")
        return self.transport.allocate_kv_cache(KVLayout(L, blocks, bs, heads, dim, dtype_name),
                                                device)

    def make_handle(self, request_id, block_ids, block_hashes, num_tokens,
                    lease_expires_at) -> KVHandle | None:
        if self._descriptor is None:
            self._descriptor = self.transport.serve()
        try:
            token = self.transport.grant(request_id, block_ids,
                                         binding_digest(block_ids, block_hashes, num_tokens))
        except KVTransferError as e:  # e.g. every shm lease slot taken: decode recomputes
            logger.warning("no KV handle for %s: %s", request_id, e)
            return None
        return KVHandle(request_id, self.transport.engine_id, self._descriptor,
                        tuple(block_ids), tuple(block_hashes), num_tokens, lease_expires_at,
                        lease_token=token)

    def revoke(self, request_id: str) -> None:
        self.transport.revoke(request_id)

    def start_load(self, request_id, handle, remote_block_ids, local_block_ids) -> None:
        self._pool.submit(self._load, request_id, handle, list(remote_block_ids),
                          list(local_block_ids))

    def skip_load(self, handle: KVHandle) -> None:
        self._pool.submit(self._let_go, handle)

    def _let_go(self, handle: KVHandle) -> None:
        try:
            self.on_loaded(handle)
        except Exception:  # noqa: BLE001 - best effort: the producer's lease expires anyway
            logger.exception("after reading nothing of %s: on_loaded failed", handle.request_id)

    def _load(self, request_id: str, handle: KVHandle, remote: list[int],
              local: list[int]) -> None:
        start = time.perf_counter()
        try:
            if handle.connector != self.kind:
                raise KVTransferError(f"handle uses connector {handle.connector!r}, "
                                      f"this engine reads {self.kind!r}")
            if handle.lease_expires_at and time.time() > handle.lease_expires_at:
                raise KVTransferError("the producer's lease on these blocks has expired")
            # The token with the binding of what this handle claims: a handle whose blocks,
            # hashes or token count are not the granted ones reads nothing.
            binding = binding_digest(handle.block_ids, handle.block_hashes, handle.num_tokens)
            moved = self.transport.read_blocks(handle.descriptor, remote, local, lease=(
                handle.request_id, f"{handle.lease_token}.{binding}"))
            result = LoadResult(request_id, True, "", moved, time.perf_counter() - start, handle)
        except Exception as e:  # noqa: BLE001 - every failure is reported, none is lost
            result = LoadResult(request_id, False, f"{type(e).__name__}: {e}", 0,
                                time.perf_counter() - start, handle)
        self._done.put(result)
        for listener in self._load_listeners:
            listener()
        self._let_go(handle)

    def take_finished_loads(self) -> list[LoadResult]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        self._load_listeners.append(listener)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.transport.close()
