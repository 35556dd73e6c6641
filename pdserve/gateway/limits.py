"""The HTTP gateway's default admission limits, shared by its flags and its app (a module of
constants: the command line reads them without loading the app)."""

DEFAULT_MAX_CONCURRENCY = 64  # backend requests in flight; beyond: HTTP 429
DEFAULT_MAX_BODY_BYTES = 8 << 20  # larger request bodies: HTTP 413
