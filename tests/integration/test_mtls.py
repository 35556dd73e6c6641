"""Mutual TLS: a router, a prefill and a decode process given certificates signed by one CA
talk only TLS, to peers presenting a certificate from that CA; a client with one is served."""

import datetime
import ipaddress
import os
import subprocess
import sys
import time

import grpc
import pytest
from cluster_procs import free_port, stop_process

from pdserve import LLM, SamplingParams
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

PROMPT = list(range(6000, 6040))


def _name(cn: str):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name, issuer_key, ca: bool):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(folder, name: str) -> dict[str, str]:
    """A CA and one certificate it signs (for servers and clients alike), as PEM files."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert(f"{name} CA", ca_key, _name(f"{name} CA"), ca_key, ca=True)
    cert = _cert(f"{name} node", key, ca.subject, ca_key, ca=False)
    files = {"ca": ca.public_bytes(serialization.Encoding.PEM),
             "cert": cert.public_bytes(serialization.Encoding.PEM),
             "key": key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())}
    paths = {}
    for kind, data in files.items():
        path = folder / f"{name}-{kind}.pem"
        path.write_bytes(data)
        paths[kind] = str(path)
    return paths


def tls_flags(pki: dict[str, str]) -> list[str]:
    return ["--tls-cert-file", pki["cert"], "--tls-key-file", pki["key"],
            "--tls-ca-file", pki["ca"]]


def channel(address: str, pki: dict[str, str] | None, with_cert: bool = True):
    if pki is None:
        return grpc.insecure_channel(address)
    read = {k: open(v, "rb").read() for k, v in pki.items()}
    creds = grpc.ssl_channel_credentials(
        read["ca"], read["key"] if with_cert else None, read["cert"] if with_cert else None)
    return grpc.secure_channel(address, creds)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    pki, outsider = make_pki(folder, "cluster"), make_pki(folder, "outsider")
    router_port = free_port()
    router = f"127.0.0.1:{router_port}"
    common = ["--model", str(tiny_model_dir), *tls_flags(pki)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "pdserve.cli", "router", *common,
                               "--grpc-port", str(router_port), "--disagg-threshold", "16"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)]
    for role in ("prefill", "decode"):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", role, *common, "--connector", "tcp",
             "--router", router, "--instance-id", f"{role}-0",
             "--kv-cache-memory-bytes", str(8 << 20)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    try:
        stub = router_pb2_grpc.RouterStub(channel(router, pki))
        deadline = time.monotonic() + 120
        while True:
            assert all(p.poll() is None for p in procs), "a server exited"
            try:
                listed = stub.ListInstances(router_pb2.ListInstancesRequest(), timeout=2)
                if {i.instance_id for i in listed.instances} == {"prefill-0", "decode-0"}:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "the TLS cluster did not come up"
            time.sleep(0.2)
        yield router, pki, outsider
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def generate(ch):
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=PROMPT),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return list(router_pb2_grpc.RouterStub(ch).Generate(request, timeout=30))


def test_a_client_with_a_cluster_certificate_is_served(cluster, tiny_model_dir):
    router, pki, _ = cluster
    msgs = generate(channel(router, pki))
    assert msgs[-1].served_by.disaggregated  # prefill and decode talked TLS too
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20)
    want = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert [t for m in msgs for t in m.token_ids] == want


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "another CA"])
def test_everyone_else_is_refused(cluster, who):
    router, pki, outsider = cluster
    ch = {"plaintext": lambda: channel(router, None),
          "no client certificate": lambda: channel(router, pki, with_cert=False),
          "another CA": lambda: channel(router, outsider)}[who]()
    with pytest.raises(grpc.RpcError) as e:
        generate(ch)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
