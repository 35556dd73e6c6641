"""KV transport over NIXL agents (UCX backend): one-sided READs of registered memory.

Each transport has two agents. The reading agent registers this engine's whole cache, the local
side of every READ. The serving agent (started by `serve()`) registers nothing up front: it
registers a lease's blocks only when a reader presents that lease's token, and deregisters them
when the lease ends (nixl_leases.py). Its descriptor carries only its connection info.
A read: load the producer's connection info once, ask for the lease's registration (one
notification each way; the registrations a reader has loaded stay loaded, and a read that
fails reloads the peer afresh), then build one descriptor per (plane, run of consecutive blocks) on both
sides and READ them in a single transfer request.

NIXL's own progress thread busy-polls (it takes a whole core), so agents run without it: the
consumer drives progress while it polls its transfer, and the serving agent gets a light Python
thread that calls `get_new_notifs()` every `poll_interval_s` (UCX-over-TCP peers need the target
to progress; intra-host CMA reads do not).

Descriptor extra keys: {"agent_name": str, "agent_metadata": base64 str (connection info only),
"base_addr": int, "device_id": int, "mem_type": "DRAM"|"VRAM"}.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import torch

from pdserve.kv_transfer.block_runs import BlockRun
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.nixl_leases import LeaseServer, block_descs, lease_request, parse_reply
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
        self._api = _import_nixl()
        self._backends = list(backends)
        self.agent_name = f"{self.engine_id}-{uuid.uuid4().hex[:12]}"
        self.poll_interval_s = float(poll_interval_s)
        self._agent = self._new_agent(self.agent_name)
        self._reg_descs: Any = None
        self._remotes: dict[str, str] = {}  # descriptor agent_name -> name returned by NIXL
        self._server: LeaseServer | None = None
        self._serve_lock = threading.Lock()
        self._descriptor_cache: dict[str, Any] | None = None

    def _new_agent(self, name: str) -> Any:
        config = self._api.nixl_agent_config(
            enable_prog_thread=False, backends=self._backends,
            sync_mode=self._api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            return self._api.nixl_agent(name, config)
        except Exception as e:
            raise KVTransferError(f"cannot create NIXL agent {name!r}: {e}") from e

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
        with self._serve_lock:
            if self._descriptor_cache is None:
                name = f"{self.agent_name}-serve"
                self._server = LeaseServer(
                    self._new_agent(name), self._api, cache.data_ptr(), self.layout,
                    max(cache.get_device(), 0), _mem_type(cache), self.check_grant,
                    self.poll_interval_s, name=f"kv-nixl-serve-{self.engine_id}")
                metadata = self._server.connection_metadata()
                self._descriptor_cache = self._descriptor(
                    agent_name=name, agent_metadata=base64.b64encode(metadata).decode("ascii"),
                    base_addr=cache.data_ptr(), device_id=max(cache.get_device(), 0),
                    mem_type=_mem_type(cache))
            return self._descriptor_cache

    def revoke(self, lease_id: str) -> None:
        super().revoke(lease_id)
        if self._server is not None:
            self._server.revoke(lease_id)

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
        local = block_descs(cache.data_ptr(), self.layout, runs, use_remote=False,
                            device_id=max(cache.get_device(), 0))
        far = block_descs(base, remote_layout, runs, use_remote=True, device_id=dev)
        handle = None
        try:
            blocks = [r.remote_start + i for r in runs for i in range(r.count)]
            self._agent.add_remote_agent(self._lease_metadata(peer, lease, blocks))
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

    def _lease_metadata(self, peer: str, lease: tuple[str, str], blocks: Sequence[int]) -> bytes:
        """Ask the producer for the registration of `blocks` under `lease`; its metadata."""
        nonce = secrets.token_hex(8)
        reply_to = self._agent.get_partial_agent_metadata(
            self._api.nixlBind.nixlRegDList(self._agent.nixl_mems["DRAM"], []),
            inc_conn_info=True, backends=["UCX"])
        self._agent.send_notif(peer, lease_request(nonce, lease, blocks, reply_to))
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        while time.monotonic() < deadline:
            for message in self._agent.get_new_notifs().get(peer, []):
                metadata = parse_reply(message, nonce)
                if metadata is not None:
                    return metadata
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 1e-3)
        raise KVTransferError(f"the nixl producer {peer!r} did not answer the lease request "
                              f"within {self.timeout_s:.1f}s")

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
        if self._server is not None:
            self._server.close()
            self._server = None
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
