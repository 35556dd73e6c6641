"""The worker-side KV transport interface: move paged KV blocks between two engine processes.

An engine's cache is one tensor of shape
    (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)   # K at [:, 0], V at [:, 1]
and "block b" is `kv_cache[:, :, b]`: num_layers * 2 contiguous chunks ("planes" p = layer*2 + kv)
of `block_size * num_kv_heads * head_dim * elem` bytes each.

A producer (prefill) allocates its cache through its transport, fills it, and publishes the
JSON-serialisable descriptor returned by `serve()`. A consumer (decode) passes that descriptor to
`read_blocks`, which copies the chosen remote blocks into its own cache.

Descriptor (common keys; each backend adds its own, see its module):
    {"kind": "shm"|"tcp"|"nixl", "version": 2, "engine_id": str, "layout": KVLayout.to_dict()}
"""

from __future__ import annotations

import hashlib
import hmac
import math
import mmap
import secrets
import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from collections.abc import Sequence
from typing import Any, ClassVar, Self

import numpy as np
import torch

from pdserve.kv_transfer.block_runs import BlockRun, coalesce_runs
from pdserve.kv_transfer.errors import KVTransferError

# 2: leases bound to their handle's claims (binding_digest), shm's lease board. A producer and
# a reader of different versions refuse each other's descriptors by name, not by a lease error.
DESCRIPTOR_VERSION = 2

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class KVLayout:
    """What both sides of a transfer must agree on (num_blocks may differ between them)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive")

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> KVLayout:
        """Layout of an existing cache tensor (layers, 2, blocks, block_size, kv_heads, head_dim)."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be (layers, 2, blocks, block_size, kv_heads, head_dim), "
                             f"got {tuple(kv_cache.shape)}")
        names = {v: k for k, v in _DTYPES.items()}
        if kv_cache.dtype not in names:
            raise ValueError(f"unsupported KV dtype {kv_cache.dtype}")
        layers, _, blocks, block_size, heads, head_dim = kv_cache.shape
        return cls(layers, blocks, block_size, heads, head_dim, names[kv_cache.dtype])

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        try:
            return cls(**{k: d[k] for k in ("num_layers", "num_blocks", "block_size",
                                            "num_kv_heads", "head_dim", "dtype")})
        except (KeyError, TypeError) as e:
            raise KVTransferError(f"malformed KV layout in descriptor: {d!r}") from e

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def num_planes(self) -> int:
        """Contiguous (layer, k/v) planes: num_layers * 2."""
        return self.num_layers * 2

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one block within one plane."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.elem_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block (all planes)."""
        return self.chunk_bytes * self.num_planes

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def check_compatible(self, remote: KVLayout) -> None:
        """Raise KVTransferError unless `remote` blocks can be copied into this layout."""
        mine = asdict(self) | {"num_blocks": 0}
        theirs = asdict(remote) | {"num_blocks": 0}
        if mine != theirs:
            diff = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs[k]}
            raise KVTransferError(f"KV layouts differ (remote, local): {diff}")


def prefault(cache: torch.Tensor) -> None:
    """Write a zero into every page of a zeroed CPU cache, so that the OS maps them all now
    rather than on each block's first use (a page fault per 4 KiB in the step that writes
    it). A no-op off CPU."""
    if cache.device.type != "cpu" or cache.numel() == 0:
        return
    per_page = max(1, mmap.PAGESIZE // cache.element_size())
    cache.view(-1)[::per_page].zero_()


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """A zeroed cache tensor. On CPU it lives in an anonymous mapping, whose pages the OS
    zeroes when first touched: a 4 GiB cache costs no time and no memory until its blocks are
    used (torch.zeros writes every byte at once: seconds, and the whole size resident)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes)  # kept alive by the tensor (torch.frombuffer)
    # Fewer page faults and TLB misses where the kernel gives shared memory transparent huge
    # pages (its transparent_hugepage/shmem_enabled; "never" on the development machine, where
    # a private mapping with huge pages left decode step times unchanged).
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def binding_digest(block_ids: Sequence[int], block_hashes: Sequence[int],
                   num_tokens: int) -> str:
    """A lease's binding to what its handle claims (16 hex digits): the producer folds it into
    the grant, the reader recomputes it from the handle it holds (KVTransport.grant)."""
    data = np.array([len(block_ids), *block_ids, len(block_hashes), *block_hashes, num_tokens],
                    dtype=np.int64)
    return hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()


def plane_bytes(cache: torch.Tensor) -> torch.Tensor:
    """(layers, 2, blocks, ...) contiguous cache -> (planes, blocks, chunk_bytes) uint8 view, no copy."""
    return cache.view(cache.shape[0] * 2, cache.shape[2], -1).view(torch.uint8)


class KVTransport(ABC):
    """Serves this engine's KV cache to peers and reads peers' blocks into it.

    One instance per engine; it owns the cache tensor returned by `allocate_kv_cache`.
    `read_blocks` is thread-safe (calls are serialised); every wait is bounded by `timeout_s`.
    """

    kind: ClassVar[str]

    def __init__(self, engine_id: str, timeout_s: float = 10.0) -> None:
        self.engine_id = str(engine_id)
        self.timeout_s = float(timeout_s)
        self._kv_cache: torch.Tensor | None = None
        self._read_lock = threading.Lock()
        self._closed = False
        # Leases this producer serves: lease id -> (token, block ids). See grant().
        self._grants: dict[str, tuple[str, frozenset[int]]] = {}
        self._grants_lock = threading.Lock()

    # ----------------------------------------------------------------- both sides
    @abstractmethod
    def allocate_kv_cache(self, layout: KVLayout, device: str | torch.device = "cpu") -> torch.Tensor:
        """Zeroed cache (layout.shape) in memory this transport can serve from and write into."""

    @property
    def kv_cache(self) -> torch.Tensor:
        """This engine's cache: (layers, 2, blocks, block_size, kv_heads, head_dim)."""
        if self._kv_cache is None:
            raise KVTransferError(f"{self.kind} transport {self.engine_id!r}: no KV cache allocated yet")
        return self._kv_cache

    @property
    def layout(self) -> KVLayout:
        return KVLayout.of(self.kv_cache)

    # ----------------------------------------------------------------- producer side
    @abstractmethod
    def serve(self) -> dict[str, Any]:
        """Start serving this engine's cache; return the JSON-serialisable descriptor. Idempotent."""

    def grant(self, lease_id: str, block_ids: Sequence[int], binding: str = "") -> str:
        """Let a reader presenting the returned token read `block_ids` until `revoke`.

        With a `binding` (binding_digest of what the handle claims), the reader presents
        "<token>.<binding>", the binding computed from the handle it was given: a handle whose
        blocks, hashes or token count were changed reads nothing. tcp and nixl producers check
        the token per read or registration; shm readers check it on the producer's board.
        """
        token = secrets.token_urlsafe(32)
        with self._grants_lock:
            self._grants[lease_id] = (f"{token}.{binding}" if binding else token,
                                      frozenset(int(b) for b in block_ids))
        return token

    def revoke(self, lease_id: str) -> None:
        with self._grants_lock:
            self._grants.pop(lease_id, None)

    def check_grant(self, lease_id: str, token: str, block_ids: Sequence[int]) -> None:
        """Raise KVTransferError unless `token` is the live grant of `lease_id` and covers
        every one of `block_ids` (the token is compared in constant time)."""
        with self._grants_lock:
            grant = self._grants.get(lease_id)
        if grant is None or not hmac.compare_digest(grant[0].encode(), token.encode()):
            raise KVTransferError(f"no live lease {lease_id!r} for this token "
                                  "(released, expired, or never granted)")
        outside = [b for b in block_ids if b not in grant[1]]
        if outside:
            raise KVTransferError(f"blocks {outside[:8]} are not in lease {lease_id!r}")
        if len(set(block_ids)) != len(block_ids):  # one lease's blocks once: no amplification
            raise KVTransferError(f"block ids repeat in one request for lease {lease_id!r}")

    def _descriptor(self, **extra: Any) -> dict[str, Any]:
        return {"kind": self.kind, "version": DESCRIPTOR_VERSION, "engine_id": self.engine_id,
                "layout": self.layout.to_dict(), **extra}

    # ----------------------------------------------------------------- consumer side
    def read_blocks(self, remote: dict[str, Any], remote_block_ids: list[int],
                    local_block_ids: list[int], lease: tuple[str, str] = ("", "")) -> int:
        """Copy remote blocks into this engine's cache at `local_block_ids`; return bytes moved.

        `lease` is (lease id, token) from the producer's handle (see `grant`).

        Raises KVTransferError on a bad descriptor, out-of-range/mismatched ids, a dead or
        unreachable producer, or a timeout. Never hangs.
        """
        if self._closed:
            raise KVTransferError(f"{self.kind} transport {self.engine_id!r} is closed")
        if not isinstance(remote, dict) or remote.get("kind") != self.kind:
            got = remote.get("kind") if isinstance(remote, dict) else type(remote).__name__
            raise KVTransferError(f"descriptor kind {got!r} cannot be read by a {self.kind!r} transport")
        if remote.get("version") != DESCRIPTOR_VERSION:
            raise KVTransferError(f"descriptor version {remote.get('version')!r}: this engine "
                                  f"reads version {DESCRIPTOR_VERSION} (upgrade the prefill "
                                  f"and decode instances together)")
        remote_layout = KVLayout.from_dict(remote.get("layout") or {})
        local_layout = self.layout
        local_layout.check_compatible(remote_layout)
        runs = coalesce_runs(remote_block_ids, local_block_ids,
                             remote_layout.num_blocks, local_layout.num_blocks)
        if not runs:
            return 0
        with self._read_lock:
            self._read_runs(remote, remote_layout, runs, lease)
        return len(remote_block_ids) * local_layout.block_bytes

    @abstractmethod
    def _read_runs(self, remote: dict[str, Any], remote_layout: KVLayout, runs: list[BlockRun],
                   lease: tuple[str, str]) -> None:
        """Backend copy of validated, coalesced runs into self.kv_cache."""

    # ----------------------------------------------------------------- lifetime
    @abstractmethod
    def close(self) -> None:
        """Stop serving and release (unlink/unregister) everything. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
