"""Mutual TLS for pdserve's gRPC servers and channels, when certificates are given.

Every process of a cluster gets the cluster CA's certificate and a certificate of its own
signed by it (`--tls-cert-file`, `--tls-key-file`, `--tls-ca-file`). Servers then accept only
TLS connections from peers presenting a certificate that CA signed, and channels present their
own and check the server's. The cluster secret and API keys (auth.py) still apply on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

FLAGS = {"cert": "--tls-cert-file", "key": "--tls-key-file", "ca": "--tls-ca-file"}


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror}") from e
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag}: {path!r} is not a PEM file")
    return data


@dataclass(frozen=True)
class TlsFiles:
    """This process's certificate chain and key, and the CA its peers must be signed by
    (PEM bytes, read once)."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def load(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """None when no file is given; ValueError naming the flag when only some are."""
        given = {"cert": cert, "key": key, "ca": ca}
        if not any(given.values()):
            return None
        missing = [FLAGS[k] for k, v in given.items() if not v]
        if missing:
            raise ValueError(f"{', '.join(missing)}: mutual TLS needs all of "
                             f"{', '.join(FLAGS.values())}")
        return cls(*(_read(v, FLAGS[k]) for k, v in given.items()))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)
