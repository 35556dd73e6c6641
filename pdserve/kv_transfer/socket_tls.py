"""Mutual TLS for the tcp KV transport, from the cluster's PEM certificates (the same files as
the gRPC plane's `--tls-*-file` flags): the producer accepts only readers presenting a
certificate the cluster CA signed, and readers check the producer's certificate and host name."""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class SocketTls:
    """Server and client SSL contexts of one process."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def from_pem(cls, cert: bytes, key: bytes, ca: bytes) -> SocketTls:
        """Contexts presenting `cert`/`key` and trusting only `ca` (all PEM bytes)."""
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and host name
        # ssl loads a key pair only from files: a private directory, removed at once.
        with tempfile.TemporaryDirectory(prefix="pdserve-tls-") as folder:
            cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
            for path, data in ((cert_path, cert), (key_path, key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            for context in (server, client):
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                context.load_cert_chain(cert_path, key_path)
                context.load_verify_locations(cadata=ca.decode("ascii"))
        server.verify_mode = ssl.CERT_REQUIRED  # mutual: a reader must present one too
        return cls(server, client)
