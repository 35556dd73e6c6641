"""Leases a shared-memory producer publishes to its readers, in its own segment.

A reader maps the producer's cache directly, so nothing stands between it and blocks that a
lease no longer covers (released, expired, then filled with another prompt's KV). The segment
therefore ends with a board of LEASE_SLOTS 64-bit words: a live lease holds a random nonzero
nonce in its slot, and its token names the slot and the nonce. A reader checks the word before
and after its copy; a lease that ended before or during the copy (the producer clears the word
before the blocks can be reused) fails the read instead of handing over other KV.

NOTE: the check relies on stores becoming visible in program order (x86's TSO); the producer
clears the word before it frees the blocks, and a new prompt's KV is written a step later.
"""

from __future__ import annotations

import secrets
import threading

import numpy as np

from pdserve.kv_transfer.errors import KVTransferError

LEASE_SLOTS = 1 << 16  # leases a producer serves at once: 512 KiB of its segment
SLOT_BYTES = 8


class LeaseBoard:
    """The producer's side: a slot per live lease in `words` (uint64, shared)."""

    def __init__(self, words: np.ndarray):
        self.words = words  # (slots,) uint64 in the shared segment
        self._lock = threading.Lock()
        self._free = list(range(len(words) - 1, -1, -1))
        self._slot_of: dict[str, int] = {}

    def grant(self, lease_id: str, binding: str = "") -> str:
        """Publish a lease; its token for readers ("<slot>.<nonce>"). The word holds the
        nonce XOR the binding (KVTransport.grant), which a reader presents after the token.
        KVTransferError when every slot is taken."""
        self.revoke(lease_id)  # a lease granted again gets a new nonce
        bound = int(binding or "0", 16)
        with self._lock:
            if not self._free:
                raise KVTransferError(f"all {len(self.words)} shm lease slots are taken")
            slot = self._free.pop()
            nonce = 0
            while nonce ^ bound == 0:
                nonce = secrets.randbits(63) | 1
            self.words[slot] = nonce ^ bound
            self._slot_of[lease_id] = slot
        return f"{slot}.{nonce}"

    def revoke(self, lease_id: str) -> None:
        with self._lock:
            slot = self._slot_of.pop(lease_id, None)
            if slot is not None:
                self.words[slot] = 0
                self._free.append(slot)


def check_lease(words: np.ndarray, token: str) -> None:
    """The reader's side: KVTransferError unless `token` ("<slot>.<nonce>[.<binding>]") names
    a live lease in `words`, granted for that binding."""
    parts = token.split(".")
    slot_text, nonce_text, binding = (parts + [""])[:3] if len(parts) in (2, 3) else ("", "", "")
    if not (slot_text.isdigit() and nonce_text.isdigit() and len(token) <= 64
            and all(c in "0123456789abcdef" for c in binding) and len(binding) <= 16):
        raise KVTransferError("malformed shm lease token")
    slot, word = int(slot_text), int(nonce_text) ^ int(binding or "0", 16)
    if slot >= len(words) or word == 0 or word >= 1 << 64 or int(words[slot]) != word:
        raise KVTransferError("the producer's lease on these blocks has ended, or is not "
                              "for these blocks")
