"""pip dry runs (nothing is installed) of scripts/choose_torch.py's two choices together with
what `setup.sh --test` installs after torch (pdserve's requirements and the test extra).

The CPU choice, as it is made on this machine, resolves to a CPU build. The CUDA choice,
resolved for a Linux x86_64 machine, resolves to PyPI's CUDA build and the triton it pins, which
the test extra's unpinned triton accepts (a triton pin of our own would break this resolution).
Both need PyPI: skipped, saying so, when it cannot be reached.
"""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import pytest
from install_scripts import PYPROJECT, ROOT, choose_torch
from packaging.requirements import Requirement


def _pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10):
            return True
    except OSError:
        return False


REACHABLE = _pypi_reachable()
pytestmark = [pytest.mark.network,
              pytest.mark.skipif(not REACHABLE,
                                 reason="PyPI (pypi.org) cannot be reached: no dry run")]

# What `setup.sh --test` installs after torch.
PDSERVE_REQS = [*PYPROJECT["dependencies"], *PYPROJECT["optional-dependencies"]["test"]]
# A Linux x86_64 machine: manylinux wheels of any glibc up to 2.28 (torch's).
LINUX_X86_64 = [arg for tag in [*(f"manylinux_2_{n}_x86_64" for n in range(28, 4, -1)),
                                "manylinux2014_x86_64", "manylinux2010_x86_64",
                                "manylinux1_x86_64", "linux_x86_64"]
                for arg in ("--platform", tag)]


def chosen(kind: str) -> list[str]:
    """The pip arguments choose_torch.py prints for `--cpu` / `--gpu`, as setup.sh runs it."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts/choose_torch.py"), f"--{kind}"],
                          capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.splitlines()


_STARTED: dict[str, tuple[subprocess.Popen, Path]] = {}  # kind -> (pip, its report file)
_FAILED: list[BaseException] = []  # what went wrong starting them, raised by report()
_starter: threading.Thread | None = None


def start_dry_runs() -> None:
    """Start both choices' `pip install --dry-run`, side by side, once, from a thread (asking
    choose_torch.py for the arguments waits on PyPI too). tests/conftest.py calls this when
    these tests are selected: they mostly wait on the network (20-40 s), and the rest of the
    suite runs meanwhile."""
    global _starter
    if _starter is None and REACHABLE:
        _starter = threading.Thread(target=_start, daemon=True, name="pip-dry-runs")
        _starter.start()


def _start() -> None:
    try:
        out_dir = Path(tempfile.mkdtemp(prefix="pdserve-dry-run-"))
        atexit.register(_stop, out_dir)
        cpu, gpu = chosen("cpu"), chosen("gpu")
        if cpu[0] == "--index-url":  # torch from PyTorch's CPU index, the rest from the default
            cpu = ["--extra-index-url", *cpu[1:]]
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        for kind, args in (
                ("cpu", ["--ignore-installed", *cpu, *PDSERVE_REQS]),
                ("gpu", ["--only-binary=:all:", *LINUX_X86_64, "--python-version", python,
                         "--target", str(out_dir / "target"), *gpu, *PDSERVE_REQS])):
            report_file = out_dir / f"{kind}.json"
            with open(out_dir / f"{kind}.log", "w") as log:
                _STARTED[kind] = (subprocess.Popen(
                    [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                     "--disable-pip-version-check", "--report", str(report_file), *args],
                    stdout=log, stderr=subprocess.STDOUT), report_file)
    except BaseException as e:  # noqa: BLE001 - the tests that need them fail with it
        _FAILED.append(e)


def _stop(out_dir: Path) -> None:
    """No pip left running, no files left behind."""
    for proc, _ in _STARTED.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(out_dir, ignore_errors=True)


def report(kind: str) -> dict[str, dict]:
    """The metadata of each distribution `kind`'s dry run would install."""
    start_dry_runs()
    assert _starter is not None
    _starter.join(timeout=600)
    if _FAILED:
        raise _FAILED[0]
    proc, report_file = _STARTED[kind]
    try:
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = report_file.with_suffix(".log").read_text()
    assert proc.returncode == 0, log[-3000:]
    return {i["metadata"]["name"].lower(): i["metadata"]
            for i in json.loads(report_file.read_text())["install"]}


@pytest.fixture(scope="module")
def resolved() -> dict[str, dict[str, dict]]:
    """Both choices' resolutions."""
    return {kind: report(kind) for kind in ("cpu", "gpu")}


def test_cpu_choice_resolves_the_cpu_build(resolved):
    got = resolved["cpu"]
    torch = got["torch"]
    assert not choose_torch.is_cuda_build(torch["version"], torch.get("requires_dist") or [])
    assert not [name for name in got if name.startswith("nvidia-")]
    if sys.platform == "linux":
        assert "triton" in got  # the Triton interpreter tests' (any version)


def test_cuda_choice_resolves_the_cuda_build_and_its_triton(resolved):
    got = resolved["gpu"]
    torch = got["torch"]
    requires = torch.get("requires_dist") or []
    assert choose_torch.is_cuda_build(torch["version"], requires), torch["version"]
    assert "+cpu" not in torch["version"]
    [pin] = [Requirement(r) for r in requires if Requirement(r).name == "triton"]
    assert pin.specifier.contains(got["triton"]["version"])
