"""Socket helpers for the TCP transport: exact reads and scatter/gather I/O over many buffers."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Sequence

_IOV_BATCH = 512  # well under IOV_MAX (1024 on Linux)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Read exactly n bytes; ConnectionError on EOF, TimeoutError past `deadline`."""
    buf = bytearray(n)
    recv_into_views(sock, [memoryview(buf)], deadline)
    return bytes(buf)


def send_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Send every byte of `views` (1-D, format "B"), in order, via sendmsg (TLS: sendall)."""
    pending = [v for v in views if v.nbytes]
    if isinstance(sock, ssl.SSLSocket):  # no scatter/gather through TLS
        for view in pending:
            sock.sendall(view)
        return
    i = 0
    while i < len(pending):
        sent = sock.sendmsg(pending[i:i + _IOV_BATCH])
        i = _advance(pending, i, sent)


def recv_into_views(sock: socket.socket, views: Sequence[memoryview],
                    deadline: float | None = None) -> None:
    """Fill every byte of `views` (1-D, format "B"), in order; ConnectionError on EOF.
    With a `deadline` (time.monotonic()), the whole read must end by then (TimeoutError): a
    peer that trickles a byte at a time cannot hold it up, as a per-call timeout would let
    it. The socket's timeout is left at what remained."""
    pending = [v for v in views if v.nbytes]
    i = 0
    while i < len(pending):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the read did not end in time")
            sock.settimeout(left)
        if isinstance(sock, ssl.SSLSocket):  # TLS: no flags, no scatter/gather
            got = sock.recv_into(pending[i], pending[i].nbytes)
        elif len(pending) - i == 1:  # common case: one big buffer
            got = sock.recv_into(pending[i], pending[i].nbytes, socket.MSG_WAITALL)
        else:
            got = sock.recvmsg_into(pending[i:i + _IOV_BATCH])[0]
        if got == 0:
            raise ConnectionError("peer closed the connection mid-message")
        i = _advance(pending, i, got)


def _advance(views: list[memoryview], i: int, nbytes: int) -> int:
    """Consume nbytes from views[i:]; return the index of the first unfinished view."""
    while nbytes > 0:
        if nbytes >= views[i].nbytes:
            nbytes -= views[i].nbytes
            i += 1
        else:
            views[i] = views[i][nbytes:]
            nbytes = 0
    return i
