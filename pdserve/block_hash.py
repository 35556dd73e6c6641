"""Chained block hashes: the one definition shared by the prefix cache, KV events and router.

A block's hash covers its tokens and, through its parent's hash, every token before it:

    hash(block i) = H(hash(block i-1) || tokens of block i)        hash(block -1) = ROOT

H is SHA-256 truncated to 63 bits (fits a signed int64 in protobuf, Redis and JSON), tokens are
packed as little-endian uint32, and ROOT is derived from a fixed string. Nothing depends on
Python's per-process hash seed, so every process on every machine computes the same values.
Only full blocks are hashed.

A request with a `cache_salt` (vLLM's prompt field) chains from a root derived from the salt
instead, so its blocks match only those of requests with the same salt: tenants that do not
share a salt cannot probe each other's prompts through prefix-cache hits.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_VERSION = b"pdserve-block-hash-v1"
_MASK = (1 << 63) - 1


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & _MASK


ROOT_HASH = _digest(HASH_VERSION)
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: object) -> str | None:
    """`salt` (None: unsalted), or ValueError naming the field when it is not a non-empty
    string of at most MAX_CACHE_SALT_CHARS characters."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt: expected a string of 1-{MAX_CACHE_SALT_CHARS} "
                         f"characters, got {str(salt)[:40]!r}")
    return salt


def root_hash(cache_salt: str | None = None) -> int:
    """The parent hash of a prompt's first block: ROOT_HASH, or one derived from the salt."""
    if not cache_salt:
        return ROOT_HASH
    return _digest(HASH_VERSION + b"\0cache_salt\0" + cache_salt.encode("utf-8"))


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash one full block given its parent's hash (ROOT_HASH for the first block)."""
    packed = struct.pack(f"<q{len(token_ids)}I", parent_hash, *token_ids)
    return _digest(packed)


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_HASH
) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `parent_hash`."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int,
                        root: int = ROOT_HASH) -> None:
    """Append hashes for blocks of `token_ids` that became full since `hashes` was computed
    (`root`: the first block's parent, see root_hash)."""
    parent = hashes[-1] if hashes else root
    done = len(hashes) * block_size
    hashes.extend(hash_blocks(token_ids[done:], block_size, parent))
