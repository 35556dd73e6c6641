"""Short names that cross the wire and are stored or logged: instance ids, cache media and
request ids. Each is checked where it comes in, so no caller can make the router (or Redis)
store a megabyte string once per block, or write one into every log line of a request."""

from __future__ import annotations

import re
from typing import Any

MAX_INSTANCE_ID_CHARS = 128
MAX_REQUEST_ID_CHARS = 256  # a client's; the router adds "-<12 hex>" on the way to instances
MAX_WIRE_REQUEST_ID_CHARS = MAX_REQUEST_ID_CHARS + 32  # what instances accept
_INSTANCE_ID = re.compile(r"[A-Za-z0-9._:@/\[\]-]{1,%d}" % MAX_INSTANCE_ID_CHARS)
_MEDIUM = re.compile(r"[A-Za-z0-9_-]{1,16}")  # "gpu", "cpu", ...
# HOST:PORT with a host name, an IPv4 address or a bracketed IPv6 one
_ADDRESS = re.compile(r"[A-Za-z0-9._-]{1,253}:[0-9]{1,5}|\[[0-9A-Fa-f:.%a-z]{2,60}\]:[0-9]{1,5}")


def check_instance_id(value: Any, field: str = "instance_id") -> str:
    """`value`, or ValueError naming `field` when it is not 1-128 letters, digits or ._:@/[]-
    (a default id is "<role>-<8 hex>", a static instance's may be its HOST:PORT)."""
    if not isinstance(value, str) or not _INSTANCE_ID.fullmatch(value):
        raise ValueError(f"{field}: expected 1-{MAX_INSTANCE_ID_CHARS} letters, digits or "
                         f"'._:@/[]-', got {str(value)[:40]!r}")
    return value


def check_address(value: Any, field: str = "address") -> str:
    """`value`, or ValueError naming `field` unless it is a gRPC HOST:PORT (port 1-65535)
    without spaces or control characters: the router and instances dial it and log it."""
    if (not isinstance(value, str) or not _ADDRESS.fullmatch(value)
            or not 0 < int(value.rsplit(":", 1)[1]) < 65536):
        raise ValueError(f"{field}: expected a gRPC HOST:PORT, got {str(value)[:80]!r}")
    return value


def is_instance_id(value: Any) -> bool:
    """Whether `value` is a valid instance id (check_instance_id's rule)."""
    return isinstance(value, str) and _INSTANCE_ID.fullmatch(value) is not None


def check_medium(medium: Any) -> str:
    """`medium`, or ValueError naming the field when it is not a short name."""
    if not isinstance(medium, str) or not _MEDIUM.fullmatch(medium):
        raise ValueError(f"medium: expected up to 16 letters, digits, '_' or '-', got "
                         f"{str(medium)[:40]!r}")
    return medium


def check_request_id(value: str, limit: int = MAX_REQUEST_ID_CHARS) -> str:
    """`value` ("" for none), or ValueError when it is longer than `limit` characters or holds
    a character that is not printable (a newline would forge log lines)."""
    if len(value) > limit or not value.isprintable():
        raise ValueError(f"request_id: expected up to {limit} printable characters, got "
                         f"{len(value)} characters: {value[:40]!r}")
    return value
