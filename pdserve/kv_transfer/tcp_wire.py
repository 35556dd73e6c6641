"""The tcp KV transport's wire format, and the reader's side of its handshake.

Wire format (big-endian). Request: "!4sBI" (b"PDKV", op, payload_len) + payload;
  op HELLO=1: payload = producer engine_id (utf-8), checked once per connection; the reply's
    payload is a 32-byte challenge when the producer has a cluster secret, else empty;
  op AUTH=3: payload = HMAC-SHA256(cluster secret, challenge + engine_id); until it matches
    (compared in constant time), a producer with a secret serves no READ;
  op READ=2: payload = "!HH" (lease id length, token length), the lease id and its token
    (utf-8), then n uint32 block ids. Served only if the token is the live grant of that
    lease and the ids are all in it (KVTransport.grant): no lease, no bytes.
Reply: "!BQ" (status 0=ok/1=error, payload_len) + payload (error: utf-8 message).
READ payload order: for plane p in 0..layers*2-1 (p = layer*2 + k/v), for each id in request
order, that block's chunk of that plane.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.socket_io import recv_exact

MAGIC = b"PDKV"
OP_HELLO, OP_READ, OP_AUTH = 1, 2, 3
REQ = struct.Struct("!4sBI")
REPLY = struct.Struct("!BQ")
MAX_REQUEST_BYTES = 1 << 24
MAX_HANDSHAKE_BYTES = 256  # HELLO and AUTH frames: read before the peer is known
MAX_ERROR_BYTES = 1 << 16  # a producer's refusal is a short message
LEASE = struct.Struct("!HH")  # lengths of the lease id and of its token, in a READ


def parse_read(op: int, payload: bytes) -> tuple[str, str, list[int]]:
    """(lease id, token, block ids) of a READ payload; ValueError if it is not one."""
    if op != OP_READ or len(payload) < LEASE.size:
        raise ValueError(f"unknown op {op} or malformed payload")
    id_len, token_len = LEASE.unpack_from(payload)
    start = LEASE.size + id_len + token_len
    if start > len(payload) or (len(payload) - start) % 4:
        raise ValueError("malformed READ payload")
    lease_id = payload[LEASE.size:LEASE.size + id_len].decode(errors="replace")
    token = payload[LEASE.size + id_len:start].decode(errors="replace")
    ids = list(struct.unpack(f"!{(len(payload) - start) // 4}I", payload[start:]))
    return lease_id, token, ids


def proof(secret: bytes, challenge: bytes, engine_id: str) -> bytes:
    """A reader's answer to a producer's challenge: HMAC-SHA256 over it and the engine id."""
    return hmac.new(secret, challenge + engine_id.encode(), hashlib.sha256).digest()


def reader_handshake(conn: socket.socket, engine_id: str, secret: bytes | None,
                     deadline: float, where: str) -> None:
    """HELLO (and AUTH when the producer sends a challenge) on a fresh connection to the
    producer `where` names, all of it by `deadline` (time.monotonic()) however the producer
    paces its bytes. KVTransferError when the producer refuses, claims an oversized reply or
    needs a secret this reader lacks; OSError (TimeoutError past the deadline) when the
    connection fails."""
    hello = engine_id.encode()
    conn.sendall(REQ.pack(MAGIC, OP_HELLO, len(hello)) + hello)
    status, body = _reply(conn, deadline, where)
    if status == 0 and body:  # a challenge: prove we hold the cluster secret
        if secret is None:
            raise KVTransferError(f"{where} needs the cluster secret, and this engine has none")
        answer = proof(secret, body, engine_id)
        conn.sendall(REQ.pack(MAGIC, OP_AUTH, len(answer)) + answer)
        status, body = _reply(conn, deadline, where)
    if status != 0:
        raise KVTransferError(f"tcp handshake with {where} refused: "
                              f"{body.decode(errors='replace')}")


def _reply(conn: socket.socket, deadline: float, where: str) -> tuple[int, bytes]:
    """(status, payload) of one handshake reply, read by `deadline`."""
    status, length = REPLY.unpack(recv_exact(conn, REPLY.size, deadline))
    if length > MAX_ERROR_BYTES:
        raise KVTransferError(f"{where} sent a {length}-byte handshake reply "
                              f"(at most {MAX_ERROR_BYTES})")
    return status, recv_exact(conn, length, deadline)
