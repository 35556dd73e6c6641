"""Per-lease NIXL registrations: a producer exposes only a live lease's blocks, only to a reader
that presents the lease's token.

The producer's serving agent registers no memory up front, and its descriptor carries only its
connection info. To read, a consumer sends a notification
    b"PDKV-LEASE " + JSON {"nonce", "lease", "token", "blocks": [ids], "reply_to": base64 metadata}
(`reply_to`: the consumer's connection info, so the producer can answer). The producer checks the
token against the live grant in constant time (KVTransport.check_grant), registers exactly the
requested blocks (one region per plane and run), and answers
    b"PDKV-MD " + JSON {"nonce", "metadata": base64 partial agent metadata} or {"nonce", "error"}.
The registrations live until the lease is revoked (released or expired), then are deregistered.
What a registration key enforces is up to UCX: an RDMA NIC refuses a key that was deregistered or
an address outside it; reads through CMA (one host) or UCX's TCP transport check neither.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import numpy as np

from pdserve import untrusted_json
from pdserve.kv_transfer.block_runs import BlockRun, remote_runs
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.transport import KVLayout

REQUEST = b"PDKV-LEASE "
REPLY = b"PDKV-MD "
MAX_MESSAGE_BYTES = 1 << 20


def block_descs(base: int, layout: KVLayout, runs: Sequence[BlockRun], use_remote: bool,
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


def lease_request(nonce: str, lease: tuple[str, str], block_ids: Sequence[int],
                  reply_to: bytes) -> bytes:
    return REQUEST + json.dumps({"nonce": nonce, "lease": lease[0], "token": lease[1],
                                 "blocks": [int(b) for b in block_ids],
                                 "reply_to": base64.b64encode(reply_to).decode("ascii")}).encode()


def parse_reply(message: bytes, nonce: str) -> bytes | None:
    """The partial metadata of the reply to `nonce`; None if `message` answers another request;
    KVTransferError if the producer refused."""
    if not message.startswith(REPLY):
        return None
    try:
        body = untrusted_json.loads(message[len(REPLY):])
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("nonce") != nonce:
        return None
    if "error" in body:
        raise KVTransferError(f"the nixl producer refused the read: {body['error']}")
    try:
        return base64.b64decode(body["metadata"], validate=True)
    except (KeyError, TypeError, binascii.Error) as e:
        raise KVTransferError(f"malformed nixl lease reply: {e}") from e


def _parse_request(message: bytes) -> tuple[str, str, str, list[int], bytes]:
    """(nonce, lease id, token, block ids, reply_to metadata); ValueError if malformed."""
    if len(message) > MAX_MESSAGE_BYTES:
        raise ValueError("request too large")
    body = untrusted_json.loads(message[len(REQUEST):])
    nonce, lease, token, blocks = body["nonce"], body["lease"], body["token"], body["blocks"]
    if not all(isinstance(v, str) for v in (nonce, lease, token)) or len(nonce) > 64:
        raise ValueError("nonce, lease and token must be strings")
    if not isinstance(blocks, list) or not blocks or \
            not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise ValueError("blocks must be a non-empty list of integers")
    return nonce, lease, token, blocks, base64.b64decode(body["reply_to"], validate=True)


class LeaseServer:
    """The producer side: a NIXL agent serving registrations per lease, progressed by a thread.

    `check_grant(lease, token, block_ids)` raises unless the token is that lease's live grant
    covering the blocks (KVTransport.check_grant).
    """

    def __init__(self, agent: Any, nixl_api: Any, cache_base: int, layout: KVLayout,
                 device_id: int, mem_type: str,
                 check_grant: Callable[[str, str, Sequence[int]], None],
                 poll_interval_s: float, name: str) -> None:
        self._agent, self._api = agent, nixl_api
        self._base, self._layout, self._device_id, self._mem_type = (cache_base, layout,
                                                                      device_id, mem_type)
        self._check_grant = check_grant
        self._regs: dict[str, list[Any]] = {}  # lease id -> its registrations
        self._peers: set[str] = set()  # consumers whose connection info is loaded
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_interval_s = poll_interval_s
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def connection_metadata(self) -> bytes:
        """The agent's connection info, with no memory in it."""
        return self._agent.get_partial_agent_metadata(
            self._api.nixlBind.nixlRegDList(self._agent.nixl_mems[self._mem_type], []),
            inc_conn_info=True, backends=["UCX"])

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_interval_s):
            try:
                notifs = self._agent.get_new_notifs()  # also progresses UCX for remote peers
            except Exception:  # noqa: BLE001 - a dying peer must not kill the server
                continue
            for messages in notifs.values():
                for message in messages:
                    if message.startswith(REQUEST):
                        self._answer(message)

    def _answer(self, message: bytes) -> None:
        try:
            nonce, lease, token, blocks, reply_to = _parse_request(message)
        except (ValueError, KeyError, TypeError, binascii.Error):
            return  # no nonce or address to answer: the reader times out
        try:
            self._check_grant(lease, token, blocks)
            granted = True
        except KVTransferError:
            granted = False
        try:
            peer, known = self._peer(reply_to, keep=granted)
        except Exception:  # noqa: BLE001 - unreachable or bogus reply address
            return
        try:
            body = {"nonce": nonce, "metadata": base64.b64encode(
                self._register(lease, token, blocks)).decode("ascii")}
        except KVTransferError as e:
            body = {"nonce": nonce, "error": str(e)}
        except Exception as e:  # noqa: BLE001 - NIXL's own errors go back to the reader
            body = {"nonce": nonce, "error": f"{type(e).__name__}: {e}"}
        with suppress(Exception):  # the reader went away
            self._agent.send_notif(peer, REPLY + json.dumps(body).encode())
        if not granted and not known:  # a stranger's agent is not kept past its refusal
            with suppress(Exception):
                self._agent.remove_remote_agent(peer)

    def _peer(self, metadata: bytes, keep: bool) -> tuple[str, bool]:
        """Load a requester's agent; (its name, whether it was kept before). Only readers
        with a live grant are kept (`keep`)."""
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        known = name in self._peers
        if keep:
            self._peers.add(name)
        return name, known

    def _register(self, lease: str, token: str, blocks: list[int]) -> bytes:
        """Check the grant and register `blocks` of `lease`; their partial metadata. Under the
        lock, so a lease revoked meanwhile is either refused here or deregistered by revoke."""
        runs = [BlockRun(s, s, n) for s, n in remote_runs(sorted(set(blocks)))]
        rows = block_descs(self._base, self._layout, runs, use_remote=True,
                           device_id=self._device_id)
        with self._lock:
            if self._stop.is_set():
                raise KVTransferError("the producer is closing")
            self._check_grant(lease, token, blocks)
            reg = self._agent.register_memory(rows, self._mem_type)
            self._regs.setdefault(lease, []).append(reg)
        return self._agent.get_partial_agent_metadata(reg, inc_conn_info=False, backends=["UCX"])

    def revoke(self, lease: str) -> None:
        """Deregister everything registered for `lease`."""
        with self._lock:
            regs = self._regs.pop(lease, [])
        for reg in regs:
            with suppress(Exception):  # best effort: the agent may be closing
                self._agent.deregister_memory(reg)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        for lease in list(self._regs):
            self.revoke(lease)
        for name in self._peers:
            with suppress(Exception):  # already gone
                self._agent.remove_remote_agent(name)
