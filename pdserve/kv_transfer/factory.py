"""Build a KV transport by connector kind."""

from __future__ import annotations

from typing import Any

from pdserve.kv_transfer.transport import KVTransport

KINDS = ("shm", "tcp", "nixl")


def make_transport(kind: str, engine_id: str, **options: Any) -> KVTransport:
    """A transport of `kind` ("shm" | "tcp" | "nixl") for engine `engine_id`.

    `options` go to the backend (all take `timeout_s`; shm: `shm_dir`; tcp: `host`, `port`;
    nixl: `backends`, `poll_interval_s`). Raises ValueError for an unknown kind and
    KVTransferError if the backend's dependency (nixl) is missing.
    """
    if kind == "shm":
        from pdserve.kv_transfer.shm_transport import ShmTransport
        return ShmTransport(engine_id, **options)
    if kind == "tcp":
        from pdserve.kv_transfer.tcp_transport import TcpTransport
        return TcpTransport(engine_id, **options)
    if kind == "nixl":
        from pdserve.kv_transfer.nixl_transport import NixlTransport
        return NixlTransport(engine_id, **options)
    raise ValueError(f"unknown KV connector {kind!r}; expected one of {', '.join(KINDS)}")


def nixl_available() -> bool:
    """True if the optional nixl package imports."""
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True
