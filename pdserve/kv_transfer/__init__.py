"""Moving paged KV blocks between engine processes (disaggregated prefill -> decode).

The names below load on first use: a process that only needs a light module of this package
(`shm_segment`, which `pdserve up` uses to sweep dead instances' segments) does not import
torch through the transports.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"KVTransferError": "errors", "KINDS": "factory", "make_transport": "factory",
          "nixl_available": "factory", "KVLayout": "transport", "KVTransport": "transport"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
