"""KV transport over NIXL agents (UCX backend): one-sided READs of registered memory.

Producer: registers its cache (DRAM, or VRAM for a CUDA cache) with a NIXL agent and publishes
the agent metadata plus the cache's base address. Consumer: loads that metadata once
(`add_remote_agent`), registers its own cache, and for each call builds one descriptor per
(plane, run of consecutive blocks) on both sides and READs them in a single transfer request.

NIXL's own progress thread busy-polls (it takes a whole core), so agents run without it: the
consumer drives progress while it polls its transfer, and a serving agent gets a light Python
thread that calls `get_new_notifs()` every `poll_interval_s` (UCX-over-TCP peers need the target
to progress; intra-host CMA reads do not).

Descriptor extra keys: {"agent_name": str, "agent_metadata": base64 str, "base_addr": int,
"device_id": int, "mem_type": "DRAM"|"VRAM"}.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
import uuid
from contextlib import suppress
from typing import Any

import numpy as np
import torch

from pdserve.kv_transfer.block_runs import BlockRun
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.transport import KVLayout, KVTransport


def _import_nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as e:
        raise KVTransferError("connector 'nixl' needs the nixl package: pip install nixl==1.5.1 "
                              f"(import failed: {e})") from e
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO chatter goes to stdout
    return _api


class NixlTransport(KVTransport):
    """KV transport over NIXL/UCX (RDMA, CMA or TCP as UCX finds; DRAM or VRAM)."""

    kind = "nixl"

    def __init__(self, engine_id: str, timeout_s: float = 10.0, backends: tuple[str, ...] = ("UCX",),
                 poll_interval_s: float = 0.001) -> None:
        super().__init__(engine_id, timeout_s)
        api = _import_nixl()
        self.agent_name = f"{self.engine_id}-{uuid.uuid4().hex[:12]}"
        self.poll_interval_s = float(poll_interval_s)
        config = api.nixl_agent_config(enable_prog_thread=False, backends=list(backends),
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self._agent = api.nixl_agent(self.agent_name, config)
        except Exception as e:
            raise KVTransferError(f"cannot create NIXL agent {self.agent_name!r}: {e}") from e
        self._reg_descs: Any = None
        self._remotes: dict[str, str] = {}  # descriptor agent_name -> name returned by NIXL
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def allocate_kv_cache(self, layout: KVLayout, device: str | torch.device = "cpu") -> torch.Tensor:
        if self._kv_cache is not None:
            raise KVTransferError(f"nixl transport {self.engine_id!r} already has a KV cache")
        # (layers, 2, blocks, block_size, kv_heads, head_dim), DRAM or VRAM by device
        cache = torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device)
        try:
            self._reg_descs = self._agent.register_memory(cache)
        except Exception as e:
            raise KVTransferError(f"NIXL cannot register the KV cache: {e}") from e
        self._kv_cache = cache
        return cache

    # ------------------------------------------------------------------ producer
    def serve(self) -> dict[str, Any]:
        if self._closed:
            raise KVTransferError("nixl transport is closed")
        cache = self.kv_cache
        if self._poller is None:
            self._poller = threading.Thread(target=self._progress_loop, daemon=True,
                                            name=f"kv-nixl-progress-{self.engine_id}")
            self._poller.start()
        metadata = self._agent.get_agent_metadata()
        return self._descriptor(agent_name=self.agent_name,
                                agent_metadata=base64.b64encode(metadata).decode("ascii"),
                                base_addr=cache.data_ptr(), device_id=max(cache.get_device(), 0),
                                mem_type=_mem_type(cache))

    def _progress_loop(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            with suppress(Exception):  # a dying peer must not kill the server
                self._agent.get_new_notifs()  # progresses the UCX worker for remote peers

    # ------------------------------------------------------------------ consumer
    def _read_runs(self, remote: dict[str, Any], remote_layout: KVLayout, runs: list[BlockRun],
                   lease: tuple[str, str]) -> None:
        try:
            base = int(remote["base_addr"])
            dev, mem = int(remote["device_id"]), str(remote["mem_type"])
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"malformed nixl descriptor: missing/invalid {e}") from e
        peer = self._remote_name(remote)
        cache = self.kv_cache
        local = _descs(cache.data_ptr(), self.layout, runs, use_remote=False,
                       device_id=max(cache.get_device(), 0))
        far = _descs(base, remote_layout, runs, use_remote=True, device_id=dev)
        handle = None
        try:
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(local, _mem_type(cache)),
                self._agent.get_xfer_descs(far, mem), peer)
            self._wait(handle, self._agent.transfer(handle), peer)
        except Exception as e:  # nixl raises its own binding errors (e.g. remote disconnect)
            self._release(handle)
            self._forget(remote)  # reload the peer's metadata on the next try
            if isinstance(e, KVTransferError):
                raise
            raise KVTransferError(f"NIXL read from {peer!r} failed: {type(e).__name__}: {e}") from e
        self._release(handle)

    def _release(self, handle: Any) -> None:
        if handle is not None:
            with suppress(Exception):  # an unfinished handle may refuse release
                self._agent.release_xfer_handle(handle)

    def _wait(self, handle: Any, state: str, peer: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        while state == "PROC":
            if time.monotonic() > deadline:
                raise KVTransferError(f"NIXL read from {peer!r} timed out after {self.timeout_s:.1f}s")
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 2e-4)  # CMA reads finish inside transfer()
            state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            raise KVTransferError(f"NIXL read from {peer!r} failed (state {state})")

    def _remote_name(self, remote: dict[str, Any]) -> str:
        key = str(remote.get("agent_name"))
        name = self._remotes.get(key)
        if name is None:
            try:
                metadata = base64.b64decode(remote["agent_metadata"])
                added = self._agent.add_remote_agent(metadata)
            except Exception as e:
                raise KVTransferError(f"cannot load NIXL metadata of {key!r}: {e}") from e
            # NIXL returns the name as bytes, but keys transfers and notifications by str.
            name = added.decode() if isinstance(added, bytes) else str(added)
            self._remotes[key] = name
        return name

    def _forget(self, remote: dict[str, Any]) -> None:
        name = self._remotes.pop(str(remote.get("agent_name")), None)
        if name is not None:
            with suppress(Exception):  # already gone
                self._agent.remove_remote_agent(name)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=2.0)
        for key in list(self._remotes):
            self._forget({"agent_name": key})
        if self._reg_descs is not None:
            with suppress(Exception):  # best effort at shutdown
                self._agent.deregister_memory(self._reg_descs)
            self._reg_descs = None
        self._kv_cache = None
        self._agent = None


def _mem_type(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def _descs(base: int, layout: KVLayout, runs: list[BlockRun], use_remote: bool,
           device_id: int) -> np.ndarray:
    """(planes * runs, 3) uint64 rows (addr, len, device): one per plane and run, plane-major."""
    chunk = layout.chunk_bytes
    starts = np.array([r.remote_start if use_remote else r.local_start for r in runs], dtype=np.uint64)
    counts = np.array([r.count for r in runs], dtype=np.uint64)
    planes = np.arange(layout.num_planes, dtype=np.uint64)[:, None]  # (planes, 1)
    addr = base + (planes * layout.num_blocks + starts[None, :]) * chunk  # (planes, runs)
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr.reshape(-1)
    out[:, 1] = np.broadcast_to(counts * chunk, addr.shape).reshape(-1)
    out[:, 2] = device_id
    return out
