"""KV transport over plain TCP (no extra dependency); works across hosts.

Producer: a small threaded server (one thread per connection) on host:port (127.0.0.1:0 by
default) answers "send blocks [ids]" with the raw bytes. Consumer: one cached connection per
producer; it receives straight into its own cache's block ranges (recvmsg_into), so a CPU cache
sees no intermediate copy.

The wire format and the reader's handshake are in tcp_wire.py.

With `tls` (socket_tls.SocketTls) every connection is mutual TLS: the producer accepts only
readers presenting a certificate of the cluster's CA, and readers check the producer's.

Descriptor extra keys: {"host": str, "port": int}.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct
import threading
import time
from typing import Any

import torch

from pdserve.kv_transfer.block_runs import BlockRun, check_block_ids
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.socket_io import recv_exact, recv_into_views, send_views
from pdserve.kv_transfer.socket_tls import SocketTls
from pdserve.kv_transfer.tcp_wire import (LEASE, MAGIC, MAX_ERROR_BYTES, MAX_HANDSHAKE_BYTES,
                                          MAX_REQUEST_BYTES, OP_AUTH, OP_HELLO, OP_READ, REPLY,
                                          REQ, parse_read, proof, reader_handshake)
from pdserve.kv_transfer.transport import KVLayout, KVTransport, plane_bytes, zeroed_kv_cache
from pdserve.kv_transfer.unresponsive_peers import UnresponsivePeers

MAX_CONNECTIONS = 256  # accepted at once; more are closed at once
MAX_PEERS = 64  # producer connections a reader keeps open; the least recently used closes
MIN_READ_RATE = 10 << 20  # bytes/s: a slower producer's read fails (on top of timeout_s)
SEND_CHUNK_BLOCKS = 64  # blocks copied at a time for a reply (bounded staging memory)
UNRESPONSIVE_HOLD_S = 30.0  # after a read from a producer times out, reads from it fail at once


def run_views(cache: torch.Tensor, runs: list[tuple[int, int]]) -> list[memoryview]:
    """Byte views of a CPU cache, plane-major: for each plane, for each (start, count) run."""
    planes = plane_bytes(cache)  # (planes, blocks, chunk_bytes)
    n_planes, n_blocks, chunk = planes.shape
    flat = memoryview(planes.numpy().reshape(-1))  # format "B", no copy
    plane = n_blocks * chunk
    return [flat[p * plane + s * chunk:p * plane + (s + n) * chunk]
            for p in range(n_planes) for s, n in runs]


class TcpTransport(KVTransport):
    """KV transport over TCP sockets."""

    kind = "tcp"

    def __init__(self, engine_id: str, timeout_s: float = 10.0, host: str = "127.0.0.1",
                 port: int = 0, advertise_host: str | None = None,
                 tls: SocketTls | None = None, cluster_secret: str | None = None) -> None:
        """Serve on host:port (port 0: a free one); the descriptor names `advertise_host`
        (default: host) so a server bound to 0.0.0.0 can publish a routable address. With
        `tls`, serve and read over mutual TLS only; with `cluster_secret`, serve only readers
        that prove they hold it, and prove it to producers that ask."""
        super().__init__(engine_id, timeout_s)
        self.tls = tls
        self._secret = cluster_secret.encode() if cluster_secret else None
        self.host, self.port = host, int(port)
        self.advertise_host = advertise_host or host
        self._server: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._stop = threading.Event()
        self._peers: dict[tuple[str, int, str], socket.socket] = {}
        self._unresponsive = UnresponsivePeers(UNRESPONSIVE_HOLD_S)

    def allocate_kv_cache(self, layout: KVLayout,
                          device: str | torch.device = "cpu") -> torch.Tensor:
        if self._kv_cache is not None:
            raise KVTransferError(f"tcp transport {self.engine_id!r} already has a KV cache")
        # (layers, 2, blocks, block_size, kv_heads, head_dim)
        self._kv_cache = zeroed_kv_cache(layout.shape, layout.torch_dtype, device)
        return self._kv_cache

    # ------------------------------------------------------------------ producer
    def serve(self) -> dict[str, Any]:
        if self._closed:
            raise KVTransferError("tcp transport is closed")
        self.kv_cache  # noqa: B018 - raises if nothing to serve
        if self._server is None:
            srv = socket.create_server((self.host, self.port), backlog=64)
            srv.settimeout(0.2)  # the accept loop polls the stop flag
            self._server = srv
            self.port = srv.getsockname()[1]
            self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                                   name=f"kv-tcp-accept-{self.engine_id}")
            self._accept_thread.start()
        return self._descriptor(host=self.advertise_host, port=self.port)

    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:  # out of descriptors, say: the loop must outlive it
                if self._stop.is_set():
                    break
                time.sleep(0.1)
                continue
            with self._conns_lock:
                if self._stop.is_set() or len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    if self._stop.is_set():
                        break
                    continue
                self._conns.add(conn)
            try:
                threading.Thread(target=self._serve_conn, args=(conn,), daemon=True,
                                 name=f"kv-tcp-conn-{self.engine_id}").start()
            except RuntimeError:  # no thread to serve it
                with self._conns_lock:
                    self._conns.discard(conn)
                conn.close()

    def _serve_conn(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a vanished peer's slot
        handshake_by = time.monotonic() + self.timeout_s  # the whole proof, from accept
        try:
            if self.tls is not None:
                conn = self._wrap_accepted(conn)
            challenge = b""  # set by HELLO when this producer has a secret
            authed = self._secret is None
            while not self._stop.is_set():
                # An authenticated reader may idle until its next request (close() shuts it
                # down), then sends each frame within timeout_s; before that, the whole
                # handshake must end within timeout_s of accept, in handshake-sized frames.
                conn.settimeout(None)
                head = recv_exact(conn, REQ.size, None if authed else handshake_by)
                magic, op, length = REQ.unpack(head)
                limit = MAX_REQUEST_BYTES if authed else MAX_HANDSHAKE_BYTES
                if magic != MAGIC or length > limit:
                    self._reply_error(conn, f"bad request frame (magic={magic!r}, length={length})")
                    return
                payload = recv_exact(conn, length,
                                     time.monotonic() + self.timeout_s if authed else handshake_by)
                if op == OP_HELLO:
                    challenge = secrets.token_bytes(32) if self._secret else b""
                    self._hello(conn, payload, challenge)
                elif op == OP_AUTH:
                    authed = bool(challenge) and hmac.compare_digest(
                        payload, proof(self._secret or b"", challenge, self.engine_id))
                    if not authed:
                        return self._reply_error(conn, "cluster secret proof refused")
                    conn.sendall(REPLY.pack(0, 0))
                elif not authed:
                    return self._reply_error(conn, "this producer needs the cluster secret: "
                                                   "HELLO and AUTH first")
                else:
                    self._handle(conn, op, payload)
        except (OSError, ConnectionError):
            pass  # peer went away, timed out, or we are closing
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _wrap_accepted(self, raw: socket.socket) -> socket.socket:
        """The TLS handshake, bounded by timeout_s; OSError (ssl.SSLError) if it fails."""
        assert self.tls is not None
        raw.settimeout(self.timeout_s)
        with self._conns_lock:
            self._conns.discard(raw)
        conn = self.tls.server.wrap_socket(raw, server_side=True)
        with self._conns_lock:
            self._conns.add(conn)
        return conn

    def _hello(self, conn: socket.socket, payload: bytes, challenge: bytes) -> None:
        want = payload.decode(errors="replace")
        if want != self.engine_id:
            return self._reply_error(conn, f"this is engine {self.engine_id!r}, not {want!r}")
        conn.sendall(REPLY.pack(0, len(challenge)) + challenge)

    def _handle(self, conn: socket.socket, op: int, payload: bytes) -> None:
        try:
            lease_id, token, ids = parse_read(op, payload)
            self.check_grant(lease_id, token, ids)
        except (ValueError, KVTransferError) as e:
            return self._reply_error(conn, str(e))
        cache = self._kv_cache
        if cache is None:
            return self._reply_error(conn, "producer has no KV cache (closed)")
        if len(ids) > 4 * cache.shape[2]:
            return self._reply_error(conn, f"too many block ids ({len(ids)}) in one request")
        try:
            check_block_ids(ids, cache.shape[2], "requested")
        except KVTransferError as e:
            return self._reply_error(conn, str(e))
        # NOTE: copies, each taken while the lease holds, are what go out (plane-major, as
        # run_views): the lease may end, and its blocks take other prompts' KV, while a slow
        # reader is still being sent to. A lease that ends mid-reply cuts the connection.
        planes = cache.view(-1, *cache.shape[2:])  # (layers * 2, num_blocks, ...)
        block_bytes = planes[0, 0].numel() * cache.element_size()
        conn.sendall(REPLY.pack(0, planes.shape[0] * len(ids) * block_bytes))
        for plane in planes:
            for start in range(0, len(ids), SEND_CHUNK_BLOCKS):
                chunk = ids[start:start + SEND_CHUNK_BLOCKS]
                idx = torch.tensor(chunk, device=cache.device)
                staged = plane.index_select(0, idx).cpu().contiguous()  # (chunk, ...)
                try:
                    self.check_grant(lease_id, token, chunk)  # still live once copied
                except KVTransferError:
                    conn.shutdown(socket.SHUT_RDWR)
                    return
                send_views(conn, [memoryview(staged.view(-1).view(torch.uint8).numpy())])

    @staticmethod
    def _reply_error(conn: socket.socket, message: str) -> None:
        body = message.encode()
        conn.sendall(REPLY.pack(1, len(body)) + body)

    # ------------------------------------------------------------------ consumer
    def _read_runs(self, remote: dict[str, Any], remote_layout: KVLayout, runs: list[BlockRun],
                   lease: tuple[str, str]) -> None:
        try:
            key = (str(remote["host"]), int(remote["port"]), str(remote["engine_id"]))
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"malformed tcp descriptor: missing/invalid {e}") from e
        ids = [r + i for r, _, n in runs for i in range(n)]
        lease_id, token = (part.encode() for part in lease)
        body = (LEASE.pack(len(lease_id), len(token)) + lease_id + token
                + struct.pack(f"!{len(ids)}I", *ids))
        request = REQ.pack(MAGIC, OP_READ, len(body)) + body
        expected = len(ids) * remote_layout.block_bytes
        self._unresponsive.check(key, f"producer {key[2]!r} at {key[0]}:{key[1]}")
        self._read_from(key, request, expected, runs)

    def _read_from(self, key: tuple[str, int, str], request: bytes, expected: int,
                   runs: list[BlockRun]) -> None:
        """Send one READ and receive its `expected` bytes into `runs`; KVTransferError if the
        producer refuses, fails or is too slow. A timeout on a connection opened for this read
        holds the producer; one on a cached connection, which may have been dropped on the way
        silently, only when it is the second within the hold time."""
        for attempt in (0, 1):
            reused = key in self._peers
            try:
                conn = self._connect(key)
            except KVTransferError as e:
                if isinstance(e.__cause__, TimeoutError):
                    self._unresponsive.mark(key)
                raise
            # The whole read ends in time, however the producer paces it (it holds the
            # engine's one read slot meanwhile).
            deadline = time.monotonic() + self.timeout_s + expected / MIN_READ_RATE
            try:
                conn.settimeout(self.timeout_s)  # a deadline read may have left it shorter
                conn.sendall(request)
                status, length = REPLY.unpack(recv_exact(conn, REPLY.size, deadline))
            except (OSError, ConnectionError) as e:
                if reused and attempt == 0 and not isinstance(e, TimeoutError):
                    self._drop(key)
                    continue  # stale cached connection: retry once on a fresh one
                raise self._failed(key, e, reused) from e
            try:
                if status != 0 and length > MAX_ERROR_BYTES:
                    self._drop(key)
                    raise KVTransferError(f"producer {key[2]!r} at {key[0]}:{key[1]} sent a "
                                          f"{length}-byte refusal (at most {MAX_ERROR_BYTES})")
                if status != 0:  # refused (e.g. ids out of range); the connection stays usable
                    message = recv_exact(conn, length, deadline).decode(errors="replace")
                    raise KVTransferError(
                        f"producer {key[2]!r} at {key[0]}:{key[1]} refused: {message}")
                if length != expected:
                    self._drop(key)
                    raise KVTransferError(f"producer sent {length} bytes, expected {expected}")
                self._receive_payload(conn, runs, deadline)
                return
            except (OSError, ConnectionError) as e:
                raise self._failed(key, e, reused) from e

    def _failed(self, key: tuple[str, int, str], e: BaseException,
                reused: bool) -> KVTransferError:
        """Drop the connection to `key` after `e`; hold the producer after a timeout on a
        fresh connection, or a second one on kept connections. The error to raise."""
        self._drop(key)
        if isinstance(e, TimeoutError):
            self._unresponsive.mark(key, sure=not reused)
        return KVTransferError(f"tcp read from {key[2]!r} at {key[0]}:{key[1]} failed: "
                               f"{type(e).__name__}: {e}")

    def _receive_payload(self, conn: socket.socket, runs: list[BlockRun],
                         deadline: float) -> None:
        cache = self.kv_cache
        n_planes = cache.shape[0] * 2
        if cache.device.type == "cpu":
            recv_into_views(conn, run_views(cache, [(loc, n) for _, loc, n in runs]), deadline)
            return
        count = sum(n for _, _, n in runs)
        staged = torch.empty((n_planes, count, *cache.shape[3:]), dtype=cache.dtype)
        recv_into_views(conn, [memoryview(staged.view(-1).view(torch.uint8).numpy())],
                        deadline)
        staged = staged.view(cache.shape[0], 2, count, *cache.shape[3:]).to(cache.device)
        done = 0
        for _, loc, n in runs:
            cache[:, :, loc:loc + n].copy_(staged[:, :, done:done + n])
            done += n

    def _connect(self, key: tuple[str, int, str]) -> socket.socket:
        conn = self._peers.pop(key, None)
        if conn is not None:
            self._peers[key] = conn  # now the most recently used
            return conn
        host, port, engine_id = key
        handshake_by = time.monotonic() + self.timeout_s  # the whole handshake, however paced
        conn = None
        try:
            conn = socket.create_connection((host, port), timeout=self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = self.tls.client.wrap_socket(conn, server_hostname=host)
            reader_handshake(conn, engine_id, self._secret, handshake_by,
                             f"producer {engine_id!r} at {host}:{port}")
        except (OSError, ConnectionError, KVTransferError) as e:
            if conn is not None:
                conn.close()
            if isinstance(e, KVTransferError):
                raise
            raise KVTransferError(f"cannot reach producer {engine_id!r} at {host}:{port}: "
                                  f"{type(e).__name__}: {e}") from e
        while len(self._peers) >= MAX_PEERS:  # descriptors may name any address
            self._drop(next(iter(self._peers)))
        self._peers[key] = conn
        return conn

    def _drop(self, key: tuple[str, int, str]) -> None:
        conn = self._peers.pop(key, None)
        if conn is not None:
            conn.close()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for key in list(self._peers):
            self._drop(key)
        if self._server is not None:
            self._server.close()
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=2.0)
        self._kv_cache = None
