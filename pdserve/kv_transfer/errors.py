"""The one error type of the KV transfer layer."""


class KVTransferError(RuntimeError):
    """A KV transfer failed: bad descriptor or ids, unreachable/dead producer, or a timeout."""
