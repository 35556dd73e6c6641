"""Checking, before a server loads its model, that it will be able to listen on its port."""

from __future__ import annotations

import errno
import socket


class PortInUse(RuntimeError):
    """Another socket holds the address (the message is the one line to show the user)."""


def check_bindable(host: str, port: int, flag: str = "--port") -> None:
    """Bind `host:port` for an instant and let go, so that a busy port fails at once.

    Port 0 (the system picks a free one) and negative ports (no listener) are not checked.
    Raises PortInUse if the port is taken, ValueError naming `flag` (or --host) if the address
    cannot be bound at all (out of range, not this machine's, unresolvable, privileged).
    """
    if port <= 0:
        return
    if port > 65535:
        raise ValueError(f"{flag}: must be in 0-65535, got {port}")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host: cannot resolve {host!r} ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As the servers bind: a port whose old connections linger in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(f"port {port} on {host} is in use ({flag})") from None
            raise ValueError(f"--host/{flag}: cannot listen on {host}:{port} "
                             f"({e.strerror})") from None
