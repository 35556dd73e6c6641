"""The pdserve servers that docker-compose.yml and deploy/kubernetes/*.yaml start, read
without a container engine or a cluster: each one's command line, environment and the
addresses it binds and dials, for the checks in test_deploy_files.py.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
K8S_DIR = ROOT / "deploy" / "kubernetes"
# 1.27: the oldest release with GA gRPC probes; None: the newest the validator knows.
K8S_VERSIONS = ("1.27.0", None)
IMAGE_PREFIX = "pdserve"  # pdserve's own image (others: redis)
SERVER_ROLES = ("router", "prefill", "decode", "serve")
INSTANCE_ROLES = ("prefill", "decode")  # they advertise the address they bind
LOOPBACK = {"127.0.0.1", "localhost", "::1", ""}
UNSPECIFIED = {"0.0.0.0", "::"}
REDIS_PORT = 6379
# What the downward API would put in an environment variable (only parsed, never dialed).
FIELD_REFS = {"status.podIP": "10.1.2.3", "metadata.name": "pdserve-pod-0",
              "metadata.namespace": "default", "spec.nodeName": "node-0"}


# ---------------------------------------------------------------------------- the files

@cache
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@cache
def k8s_docs() -> tuple[tuple[str, dict], ...]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return tuple(docs)


def is_pdserve_image(image: str | None) -> bool:
    return bool(image) and image.rsplit("/", 1)[-1].startswith(IMAGE_PREFIX)


@dataclass
class Server:
    """One pdserve command line in a deploy file, and what points at it."""

    id: str
    argv: list[str]  # after the image's ENTRYPOINT ["pdserve"]
    checked_ports: dict[str, int] = field(default_factory=dict)  # what -> port it dials
    names: set[str] = field(default_factory=set)  # host names others reach it by
    platform: str = "compose"
    # k8s: Service name -> {service port: container port}
    services: dict[str, dict[int, int]] = field(default_factory=dict)
    healthcheck_hosts: set[str] = field(default_factory=set)  # compose: hosts it dials
    error: str = ""  # why it could not be read


def _compose_servers() -> list[Server]:
    servers = []
    for name, svc in compose()["services"].items():
        if not is_pdserve_image(svc.get("image")):
            continue
        try:
            servers.append(_compose_server(name, svc))
        except AssertionError as e:
            servers.append(Server(f"compose:{name}", [], error=f"compose:{name}: {e}"))
    return servers


def _compose_server(name: str, svc: dict) -> Server:
    command = svc.get("command")
    assert isinstance(command, list) and all(isinstance(a, str) for a in command), (
        "write `command` as a list of strings")
    assert svc.get("entrypoint") in (None, ["pdserve"]), (
        "the image's ENTRYPOINT is pdserve; do not override it")
    server = Server(f"compose:{name}", command, names={name, svc.get("hostname", name)})
    test = (svc.get("healthcheck") or {}).get("test") or []
    for arg in test[1:]:  # a HOST:PORT argument, or a URL inside a script
        if m := (re.fullmatch(r"([\w.-]+):(\d+)", arg)
                 or re.search(r"https?://([\w.-]+):(\d+)", arg)):
            server.checked_ports[f"healthcheck dials {m[1]}"] = int(m[2])
            server.healthcheck_hosts.add(m[1])
    for spec in svc.get("ports") or []:
        target = spec["target"] if isinstance(spec, dict) else str(spec).rsplit(":", 1)[-1]
        server.checked_ports[f"published port {spec}"] = int(str(target).split("/")[0])
    return server


def _configmaps() -> dict[str, dict]:
    return {d["metadata"]["name"]: d.get("data") or {}
            for _, d in k8s_docs() if d.get("kind") == "ConfigMap"}


def _container_env(container: dict, where: str) -> dict[str, str]:
    env, cms = {}, _configmaps()
    for e in container.get("env") or []:
        source = e.get("valueFrom") or {}
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif ref := source.get("configMapKeyRef"):
            assert ref["name"] in cms, f"{where}: env {e['name']}: no ConfigMap {ref['name']}"
            assert ref["key"] in cms[ref["name"]], (
                f"{where}: env {e['name']}: ConfigMap {ref['name']} has no key {ref['key']}")
            env[e["name"]] = str(cms[ref["name"]][ref["key"]])
        elif ref := source.get("fieldRef"):
            env[e["name"]] = FIELD_REFS.get(ref["fieldPath"], "x")
        else:
            env[e["name"]] = "1"  # resourceFieldRef, secretKeyRef
    return env


def _expand(arg: str, env: dict[str, str], where: str) -> str:
    """Kubernetes' $(VAR) expansion; an unknown $(VAR) would stay literal: an error here."""
    def sub(m: re.Match) -> str:
        assert m[1] in env, f"{where}: $({m[1]}) is not defined in the container's env"
        return env[m[1]]
    return re.sub(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def _selects(service: dict, pod_labels: dict) -> bool:
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(pod_labels.get(k) == v for k, v in selector.items())


def _k8s_servers() -> list[Server]:
    servers = []
    services = [d for _, d in k8s_docs() if d.get("kind") == "Service"]
    for fname, doc in k8s_docs():
        if doc.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]
        for c in pod["spec"]["containers"]:
            if not is_pdserve_image(c.get("image")):
                continue
            where = f"k8s:{fname}:{c['name']}"
            try:
                servers.append(_k8s_server(where, pod, c, services))
            except AssertionError as e:
                servers.append(Server(where, [], platform="k8s", error=str(e)))
    return servers


def _k8s_server(where: str, pod: dict, c: dict, services: list[dict]) -> Server:
    assert c.get("command") in (None, ["pdserve"]), (
        f"{where}: the image's ENTRYPOINT is pdserve; do not override `command`")
    env = _container_env(c, where)
    server = Server(where, [_expand(str(a), env, where) for a in c.get("args") or []],
                    platform="k8s")
    named = {p["name"]: p["containerPort"] for p in c.get("ports") or [] if "name" in p}
    for p in c.get("ports") or []:
        server.checked_ports[f"containerPort {p['containerPort']}"] = p["containerPort"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(kind) or {}
        for how in ("grpc", "httpGet", "tcpSocket"):
            if how in probe:
                port = probe[how]["port"]
                server.checked_ports[f"{kind}.{how}"] = named.get(port, port)
    labels = pod["metadata"].get("labels") or {}
    for svc in services:
        if _selects(svc, labels):
            ports = {}
            for p in svc["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                assert target in named or isinstance(target, int), (
                    f"Service {svc['metadata']['name']}: targetPort {target!r} is not "
                    f"a named port of {where}")
                ports[p["port"]] = named.get(target, target)
            server.services[svc["metadata"]["name"]] = ports
    return server


def servers() -> list[Server]:
    try:
        return _compose_servers() + _k8s_servers()
    except Exception as e:  # noqa: BLE001 - unreadable files: one failing case, not a crash
        return [Server("deploy-files", [], error=f"deploy files: {type(e).__name__}: {e}")]


# -------------------------------------------------------------- the CLI and its addresses

@cache
def _parser():
    from pdserve.cli import build_parser

    return build_parser()


def _subcommands() -> list[str]:
    import argparse

    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


def parse(server: Server):
    """The command line as `pdserve` parses it; a rejected one fails the test, with argparse's
    message."""
    if not server.argv or server.argv[0] not in _subcommands():
        pytest.fail(f"{server.id}: pdserve has no subcommand {server.argv[:1]} "
                    f"(it has: {', '.join(_subcommands())})")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return _parser().parse_args(server.argv)
        except SystemExit:
            pass
    pytest.fail(f"{server.id}: `pdserve {' '.join(server.argv)}` is rejected by the CLI:\n"
                f"{err.getvalue().strip()}")


def server_port(ns) -> int:
    return ns.grpc_port if ns.command == "router" else ns.port


def _host_port(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    assert sep and port.isdigit(), f"{what}: expected HOST:PORT, got {address!r}"
    return host, int(port)


def redis_targets(platform: str) -> dict[str, int]:
    """Host name -> port of the Redis services."""
    if platform == "compose":
        return {name: REDIS_PORT for name, svc in compose()["services"].items()
                if (svc.get("image") or "").startswith("redis")}
    redis_pods = [d["spec"]["template"]["metadata"].get("labels") or {}
                  for _, d in k8s_docs() if d.get("kind") in ("Deployment", "StatefulSet")
                  and any((c.get("image") or "").startswith("redis")
                          for c in d["spec"]["template"]["spec"]["containers"])]
    found = {}
    for _, svc in k8s_docs():
        if svc.get("kind") == "Service" and any(_selects(svc, pod) for pod in redis_pods):
            found[svc["metadata"]["name"]] = svc["spec"]["ports"][0]["port"]
    return found


def check_dials(server: Server, ns, others: list[Server]) -> None:
    """Every address the command dials names a server of the role it expects, on its port."""
    wants = [(a, "router") for a in [getattr(ns, "router", None)] if a]
    if ns.command == "router":
        wants += [(a, "prefill") for a in ns.prefill] + [(a, "decode") for a in ns.decode]
    peers = [o for o in others if o.platform == server.platform and o is not server]
    for address, role in wants:
        host, port = _host_port(address, f"{server.id}: --{role} {address}")
        host = host.split(".")[0]  # k8s: svc.namespace.svc.cluster.local
        for peer in peers:
            if server.platform == "compose" and host in peer.names:
                peer_ns = parse(peer)
                assert peer_ns.command == role, (
                    f"{server.id}: {address} is {peer.id}, a {peer_ns.command}, not a {role}")
                assert server_port(peer_ns) == port, (
                    f"{server.id}: dials {address} but {peer.id} serves on "
                    f"{server_port(peer_ns)}")
                if role in INSTANCE_ROLES:
                    assert peer_ns.host in peer.names | UNSPECIFIED, (
                        f"{peer.id} binds {peer_ns.host}, not reachable as {host}")
                break
            if server.platform == "k8s" and host in peer.services:
                peer_ns = parse(peer)
                assert peer_ns.command == role, (
                    f"{server.id}: Service {host} selects {peer.id}, a {peer_ns.command}")
                assert port in peer.services[host], (
                    f"{server.id}: Service {host} has no port {port}")
                assert peer.services[host][port] == server_port(peer_ns), (
                    f"{server.id}: Service {host}:{port} leads to container port "
                    f"{peer.services[host][port]}, but {peer.id} serves on "
                    f"{server_port(peer_ns)}")
                break
        else:
            pytest.fail(f"{server.id}: --{role} {address}: no {role} is reachable as {host}")
    if redis_url := getattr(ns, "redis_url", None):
        url = urlsplit(redis_url)
        targets = redis_targets(server.platform)
        assert url.scheme == "redis" and url.hostname in targets, (
            f"{server.id}: --redis-url {redis_url}: no Redis service named {url.hostname} "
            f"(have: {sorted(targets)})")
        assert (url.port or REDIS_PORT) == targets[url.hostname], (
            f"{server.id}: --redis-url {redis_url}: Redis listens on {targets[url.hostname]}")
