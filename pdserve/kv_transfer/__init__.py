"""Moving paged KV blocks between engine processes (disaggregated prefill -> decode)."""

from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.factory import KINDS, make_transport, nixl_available
from pdserve.kv_transfer.transport import KVLayout, KVTransport

__all__ = ["KINDS", "KVLayout", "KVTransferError", "KVTransport", "make_transport", "nixl_available"]
