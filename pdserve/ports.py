"""Ports for servers: checking, before a server loads its model, that it will be able to
listen on its port; and picking a free port for a server started a moment later."""

from __future__ import annotations

import errno
import random
import socket
import threading

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
PICK_FROM = 10000  # picked ports are in [PICK_FROM, the ephemeral range's start)
_picked: set[int] = set()  # handed out by this process: never twice
_picked_lock = threading.Lock()


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


def pick_free_port(host: str) -> int:
    """A port free on `host` now, for a server that binds it a moment later.

    Picked below the kernel's ephemeral range when there is room: a port from that range (what
    binding port 0 gives) can be taken before the server binds it by any outgoing connection
    or any bind to port 0 on the machine; ports below it are only ever taken on purpose.
    """
    low = _ephemeral_start()
    rng = random.SystemRandom()
    for _ in range(200 if low - PICK_FROM >= 1000 else 0):
        port = rng.randrange(PICK_FROM, low)
        with _picked_lock:
            if port in _picked or not _bindable(host, port):
                continue
            _picked.add(port)
        return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_start() -> int:
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
