"""Same-host KV transport over a named POSIX shared-memory segment.

Producer: the engine's cache *is* a file under /dev/shm mapped MAP_SHARED, so serving costs
nothing. Consumer: maps that file read-only by name (once, cached) and copies each coalesced run
of blocks straight from the mapping into its own cache: one strided copy per run (all planes at
once), no intermediate buffer.

The segment ends with the producer's lease board (shm_leases.py): a read checks its lease
there before and after the copy, so blocks a lease no longer covers are never handed over.

Descriptor extra keys: {"segment": "/dev/shm/<name>", "inode": int, "pid": int,
"pid_start": int, "pidns": int, "lease_slots": int} — the owner fields let a consumer detect a
dead producer.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

import numpy as np
import torch

from pdserve.kv_transfer.block_runs import BlockRun
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.shm_leases import LEASE_SLOTS, SLOT_BYTES, LeaseBoard, check_lease
from pdserve.kv_transfer.shm_segment import (
    check_segment_path,
    create_segment,
    map_segment_readonly,
    new_segment_name,
    owner_alive,
    sweep_stale_segments,
    unlink_if_owner,
    unlink_quietly,
)
from pdserve.kv_transfer.transport import KVLayout, KVTransport, plane_bytes

# Runs at least this big are copied with torch (multi-threaded); smaller ones with numpy, since
# a thread-pool barrier per small copy stalls badly when another process holds a core.
PARALLEL_COPY_BYTES = 32 << 20


class ShmTransport(KVTransport):
    """KV transport for producer and consumer on the same host (same /dev/shm)."""

    kind = "shm"

    def __init__(self, engine_id: str, timeout_s: float = 10.0, shm_dir: str = "/dev/shm") -> None:
        super().__init__(engine_id, timeout_s)
        self.shm_dir = shm_dir
        self.segment_path: str | None = None
        self._owner: dict[str, int] = {}
        self._inode = 0
        self._finalizer: weakref.finalize | None = None
        self._board: LeaseBoard | None = None
        # segment path -> (inode, read-only view of the producer's cache, its lease words)
        self._peers: dict[str, tuple[int, torch.Tensor, np.ndarray]] = {}
        self._peer_owners: dict[str, tuple[int, int, int]] = {}

    def allocate_kv_cache(self, layout: KVLayout, device: str | torch.device = "cpu") -> torch.Tensor:
        if torch.device(device).type != "cpu":
            raise KVTransferError("shm transport serves CPU caches only; use nixl for device memory")
        if self._kv_cache is not None:
            raise KVTransferError(f"shm transport {self.engine_id!r} already has a KV cache")
        sweep_stale_segments(self.shm_dir)
        name, self._owner = new_segment_name(self.engine_id)
        path = os.path.join(self.shm_dir, name)
        try:
            mm = create_segment(path, layout.total_bytes + LEASE_SLOTS * SLOT_BYTES)
        except OSError as e:
            raise KVTransferError(f"cannot create shm segment {path}: {e}") from e
        # Unlink on close, on garbage collection and at interpreter exit (in this process only).
        self._finalizer = weakref.finalize(self, unlink_if_owner, path, os.getpid())
        self.segment_path = path
        self._inode = os.stat(path).st_ino
        # (layers, 2, blocks, block_size, kv_heads, head_dim) backed by the shared mapping
        self._kv_cache = torch.frombuffer(mm, dtype=layout.torch_dtype,
                                          count=layout.total_bytes // layout.elem_size
                                          ).view(layout.shape)
        self._board = LeaseBoard(np.frombuffer(mm, dtype=np.uint64, count=LEASE_SLOTS,
                                               offset=layout.total_bytes))
        return self._kv_cache

    def serve(self) -> dict[str, Any]:
        if self.segment_path is None or self._closed:
            raise KVTransferError("shm transport: allocate_kv_cache() before serve(), and not after close()")
        return self._descriptor(segment=self.segment_path, inode=self._inode,
                                lease_slots=LEASE_SLOTS, **self._owner)

    def grant(self, lease_id: str, block_ids, binding: str = "") -> str:
        """The lease goes on the board in the segment; readers check it there."""
        if self._board is None:
            raise KVTransferError("shm transport: allocate_kv_cache() before grant()")
        return self._board.grant(lease_id, binding)

    def revoke(self, lease_id: str) -> None:
        if self._board is not None:
            self._board.revoke(lease_id)

    def _read_runs(self, remote: dict[str, Any], remote_layout: KVLayout, runs: list[BlockRun],
                   lease: tuple[str, str]) -> None:
        view, lease_words = self._peer_view(remote, remote_layout)
        check_lease(lease_words, lease[1])
        src = plane_bytes(view)  # (planes, remote_blocks, chunk)
        dst = plane_bytes(self.kv_cache)  # (planes, local_blocks, chunk)
        src_np, dst_np = src.numpy(), dst.numpy()
        for r, loc, n in runs:
            if n * remote_layout.block_bytes >= PARALLEL_COPY_BYTES:
                dst[:, loc:loc + n].copy_(src[:, r:r + n])  # big run: torch's threaded copy
            else:  # small run: one serial memcpy per plane, no thread-pool sync per run
                np.copyto(dst_np[:, loc:loc + n], src_np[:, r:r + n])
        try:
            check_lease(lease_words, lease[1])  # still live: nothing copied was reused
        except KVTransferError as e:
            raise KVTransferError(f"{e} (during the read)") from None

    def _drop_dead_peers(self) -> None:
        """Unmap the segments of producers that are gone (exited, or replaced by a restart),
        so that a dead producer's memory is not held for the life of this process."""
        for path, (inode, *_) in list(self._peers.items()):
            try:
                alive = (os.stat(path).st_ino == inode
                         and owner_alive(*self._peer_owners.get(path, (0, 0, 0))))
            except FileNotFoundError:
                alive = False
            if not alive:
                self._peers.pop(path, None)  # the mapping goes with the last view of it
                self._peer_owners.pop(path, None)

    def _peer_view(self, remote: dict[str, Any],
                   layout: KVLayout) -> tuple[torch.Tensor, np.ndarray]:
        """The producer's cache and lease words, mapped read-only; checks the producer is
        still there."""
        self._drop_dead_peers()
        try:
            inode = int(remote["inode"])
            slots = int(remote["lease_slots"])
            if not 1 <= slots <= 1 << 20:
                raise ValueError(f"lease_slots {slots} out of range")
            owner = (int(remote["pid"]), int(remote["pid_start"]), int(remote["pidns"]))
            path = check_segment_path(str(remote["segment"]), self.shm_dir, owner)
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"malformed shm descriptor: missing/invalid {e}") from e
        try:
            current_inode = os.stat(path).st_ino
        except FileNotFoundError:
            self._peers.pop(path, None)
            raise KVTransferError(f"shm segment {path} is gone: producer "
                                  f"{remote.get('engine_id')!r} closed or exited") from None
        if current_inode != inode:
            self._peers.pop(path, None)
            raise KVTransferError(f"shm segment {path} was replaced; descriptor is stale")
        if not owner_alive(*owner):
            self._peers.pop(path, None)
            unlink_quietly(path)  # the owner crashed before it could clean up
            raise KVTransferError(f"producer process {owner[0]} of shm segment {path} is dead")
        cached = self._peers.get(path)
        if cached is not None and cached[0] == inode:
            return cached[1], cached[2]
        try:
            mm, got_inode = map_segment_readonly(path, layout.total_bytes + slots * SLOT_BYTES)
        except (OSError, ValueError) as e:
            raise KVTransferError(f"cannot map shm segment {path}: {e}") from e
        if got_inode != inode:
            raise KVTransferError(f"shm segment {path} was replaced; descriptor is stale")
        with warnings.catch_warnings():  # the mapping is read-only; we never write through it
            warnings.filterwarnings("ignore", message=".*not writable.*")
            view = torch.frombuffer(mm, dtype=layout.torch_dtype,
                                    count=layout.total_bytes // layout.elem_size
                                    ).view(layout.shape)
        words = np.frombuffer(mm, dtype=np.uint64, count=slots, offset=layout.total_bytes)
        self._peers[path] = (inode, view, words)
        self._peer_owners[path] = owner
        return view, words

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._peers.clear()
        if self._finalizer is not None:
            self._finalizer()  # unlink our segment; the mapping lives while the tensor does
        self._kv_cache = None
