"""Who may call what over gRPC: a cluster secret for the internal plane, API keys for clients.

Two surfaces, two credentials:
- public (`Router.Generate`, `Router.Embed`, `Router.ListInstances`): an API key, sent as
  `authorization: Bearer KEY`, when the router has keys (the cluster secret is accepted too,
  so a gateway inside the cluster needs no key of its own);
- internal (every other method: heartbeats, KV events and resync, Prefill, Decode, Embed on
  an instance, Release, Abort, GetLoad): the cluster secret, sent as `x-pdserve-cluster-token`.
Health checks and reflection stay open (probes carry no credentials; reflection lists only
method names). Comparisons are constant-time. With no secret configured the internal plane is
open, as it has to be on a laptop; `pdserve up` always makes one.

With certificates (`--tls-cert-file`, `--tls-key-file`, `--tls-ca-file`; tls.py) every
connection is mutual TLS as well, and the checks above apply inside it.

Credentials come from files or the environment, never only from argv (where `ps` shows them):
`PDSERVE_CLUSTER_SECRET` / `--cluster-secret-file`, `PDSERVE_API_KEY` (comma-separated) /
`--api-key-file` (one key per line) / `--api-key`.
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.services.tls import TlsFiles

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
API_KEY_ENV = "PDSERVE_API_KEY"
TOKEN_HEADER = "x-pdserve-cluster-token"
PUBLIC_METHODS = frozenset({"/pdserve.v1.Router/Generate", "/pdserve.v1.Router/Embed",
                            "/pdserve.v1.Router/ListInstances"})
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
MIN_SECRET_CHARS = 16


def _read_secret_file(path: str, what: str) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path!r}: {e.strerror}") from e
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@dataclass(frozen=True)
class Credentials:
    """The cluster secret (None: internal plane open) and the accepted API keys."""

    cluster_secret: str | None = None
    api_keys: tuple[str, ...] = ()
    tls: TlsFiles | None = None  # mutual TLS on every server and channel, when given

    def __post_init__(self) -> None:
        if self.cluster_secret is not None and len(self.cluster_secret) < MIN_SECRET_CHARS:
            raise ValueError(f"cluster secret: at least {MIN_SECRET_CHARS} characters")
        if any(not k for k in self.api_keys):
            raise ValueError("api key: must not be empty")
        for what, value in [("cluster secret", self.cluster_secret or "")] + \
                [("api key", k) for k in self.api_keys]:
            if not all(33 <= ord(c) < 127 for c in value):  # a gRPC metadata value
                raise ValueError(f"{what}: printable ASCII without spaces only")

    @classmethod
    def load(cls, secret_file: str | None = None, api_keys: tuple[str, ...] = (),
             api_key_file: str | None = None, env: Mapping[str, str] = os.environ,
             tls: TlsFiles | None = None) -> Credentials:
        """From files, flags and the environment (files and flags win)."""
        secret = env.get(SECRET_ENV) or None
        if secret_file:
            lines = _read_secret_file(secret_file, "cluster_secret_file")
            if len(lines) != 1:
                raise ValueError(f"cluster_secret_file: {secret_file!r} must hold one line")
            secret = lines[0]
        keys = [k.strip() for k in env.get(API_KEY_ENV, "").split(",") if k.strip()]
        keys += list(api_keys)
        if api_key_file:
            keys += _read_secret_file(api_key_file, "api_key_file")
        return cls(secret, tuple(dict.fromkeys(keys)), tls)

    def token_ok(self, metadata: Mapping[str, str]) -> bool:
        given = metadata.get(TOKEN_HEADER, "")
        return self.cluster_secret is None or hmac.compare_digest(
            given.encode(), self.cluster_secret.encode())

    def api_key_ok(self, metadata: Mapping[str, str]) -> bool:
        if not self.api_keys:
            return True
        if self.cluster_secret is not None and self.token_ok(metadata):
            return True
        scheme, _, key = metadata.get("authorization", "").partition(" ")
        # Every key is compared, so the time taken does not tell which one nearly matched.
        matches = [hmac.compare_digest(key.encode(), k.encode()) for k in self.api_keys]
        return scheme.lower() == "bearer" and any(matches)

    def allows(self, method: str, metadata: Mapping[str, str]) -> str | None:
        """None if the call may proceed, else why not."""
        if method.startswith(OPEN_PREFIXES):
            return None
        if method in PUBLIC_METHODS:
            return None if self.api_key_ok(metadata) else "a valid API key is required " \
                "(authorization: Bearer KEY)"
        return None if self.token_ok(metadata) else "the cluster secret is required " \
            f"({TOKEN_HEADER}) for internal calls"

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """What an internal client sends with every call."""
        return ((TOKEN_HEADER, self.cluster_secret),) if self.cluster_secret else ()


def add_credential_args(parser: argparse.ArgumentParser, api_keys: bool = False) -> None:
    parser.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                        help=f"file holding the cluster secret (default: ${SECRET_ENV}; "
                        "none: internal calls are not authenticated)")
    parser.add_argument("--tls-cert-file", default=None, metavar="PATH",
                        help="this process's certificate (PEM); with --tls-key-file and "
                        "--tls-ca-file every gRPC connection is mutual TLS (default: none)")
    parser.add_argument("--tls-key-file", default=None, metavar="PATH",
                        help="the private key of --tls-cert-file (PEM)")
    parser.add_argument("--tls-ca-file", default=None, metavar="PATH",
                        help="the CA that signs every peer's certificate (PEM)")
    if api_keys:
        parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                            help=f"accept this client API key (repeatable; also "
                            f"${API_KEY_ENV}, comma-separated)")
        parser.add_argument("--api-key-file", default=None, metavar="PATH",
                            help="file of client API keys, one per line")


def credentials_from_args(args: argparse.Namespace, api_keys: bool = False) -> Credentials:
    """From the flags `add_credential_args` added (API keys only where `api_keys`)."""
    tls = TlsFiles.load(args.tls_cert_file, args.tls_key_file, args.tls_ca_file)
    if not api_keys:
        return Credentials.load(args.cluster_secret_file, env={
            k: v for k, v in os.environ.items() if k != API_KEY_ENV}, tls=tls)
    return Credentials.load(args.cluster_secret_file, tuple(args.api_key), args.api_key_file,
                            tls=tls)


# ------------------------------------------------------------------------- server side

def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that fails with UNAUTHENTICATED."""
    def deny(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def deny_stream(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this a generator, as streaming handlers are

    kinds: dict[tuple[bool, bool], Callable] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny_stream if handler.response_streaming else deny,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the credentials their method needs (UNAUTHENTICATED)."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        metadata = dict(handler_call_details.invocation_metadata or ())
        why = self.credentials.allows(handler_call_details.method, metadata)
        return handler if why is None else _denied(handler, why)


# ------------------------------------------------------------------------- client side

class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _with_token(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)


# NOTE: gRPC's default reconnect backoff grows to two minutes; a server restarted on the same
# address (or dialled before it listened) must be reachable again within a poll or two, so the
# backoff is capped at one second. `grpc.min_reconnect_backoff_ms` is left alone: it is also the
# shortest time a connection attempt may take (20 s by default), and a short one made a loaded
# instance that answers its handshake late unreachable for good.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def internal_channel(address: str, credentials: Credentials,
                     options: list[tuple[str, int]] | None = None) -> grpc.Channel:
    """A channel whose every call carries the cluster secret (when there is one), over
    mutual TLS when the credentials have certificates."""
    if credentials.tls is not None:
        channel = grpc.secure_channel(address, credentials.tls.channel_credentials(),
                                      options=options or [])
    else:
        channel = grpc.insecure_channel(address, options=options or [])
    metadata = credentials.call_metadata()
    return grpc.intercept_channel(channel, _TokenInterceptor(metadata)) if metadata else channel
