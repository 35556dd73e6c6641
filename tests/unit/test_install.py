"""The install: scripts/choose_torch.py picks the torch build (the pip dry runs of its choices
are in test_torch_resolution.py), scripts/is_installed.py makes setup.sh idempotent, and the
README's commands are the ones setup.sh and CI run."""

from __future__ import annotations

import os
import subprocess
import sys

from install_scripts import PYPROJECT, ROOT, choose_torch, is_installed

V = choose_torch.TORCH_VERSION


def test_choice_by_machine():
    assert choose_torch.choose(True, None, False).args == [f"torch==={V}"]
    assert choose_torch.choose(True, True, True).args == [f"torch==={V}"]
    assert choose_torch.choose(False, True, False) == choose_torch.Choice([f"torch=={V}"])
    via_cpu_index = choose_torch.choose(False, False, True)
    assert via_cpu_index.args == ["--index-url", choose_torch.CPU_INDEX, f"torch=={V}"]
    assert via_cpu_index.note is None
    assert choose_torch.choose(False, None, True).args == via_cpu_index.args
    fallback = choose_torch.choose(False, False, False)
    assert fallback.args == [f"torch=={V}"]
    assert choose_torch.CPU_INDEX in fallback.note and "default index" in fallback.note


def test_nvidia_driver_detection(tmp_path, monkeypatch):
    proc = tmp_path / "proc_driver_nvidia"
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert not choose_torch.has_nvidia_driver(str(proc))
    proc.mkdir()
    assert choose_torch.has_nvidia_driver(str(proc))
    smi = tmp_path / "nvidia-smi"
    for code, found in ((1, False), (0, True)):  # a driver-less nvidia-smi exits non-zero
        smi.write_text(f"#!/bin/sh\nexit {code}\n")
        smi.chmod(0o755)
        assert choose_torch.has_nvidia_driver(str(tmp_path / "absent")) is found


def test_cuda_build_recognised():
    assert choose_torch.is_cuda_build("2.13.0+cu130", [])
    assert choose_torch.is_cuda_build("2.13.0", ['nvidia-cudnn-cu13==9.20.0.48; '
                                                 'platform_system == "Linux"'])
    assert not choose_torch.is_cuda_build("2.13.0+cpu", ["filelock", "sympy>=1.13.3"])
    assert not choose_torch.is_cuda_build("2.13.0", ["filelock"])  # macOS, Windows


def test_main_prints_one_argument_per_line(monkeypatch, capsys):
    monkeypatch.setattr(choose_torch, "detect", lambda version: (False, False))
    assert choose_torch.main(["--cpu"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [f"torch=={V}"] and choose_torch.CPU_INDEX in out.err
    monkeypatch.setattr(choose_torch, "detect", lambda version: (False, True))
    choose_torch.main(["--cpu", "--version", "2.9.1"])
    assert capsys.readouterr().out.splitlines() == ["--index-url", choose_torch.CPU_INDEX,
                                                   "torch==2.9.1"]
    choose_torch.main(["--gpu"])
    assert capsys.readouterr().out.splitlines() == [f"torch==={V}"]


def test_extras_never_pin_triton():
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for group in (PYPROJECT["dependencies"],
                                         *PYPROJECT["optional-dependencies"].values())
            for r in group]
    tritons = [r for r in reqs if r.name == "triton"]
    assert tritons and all(not r.specifier for r in tritons)


def test_is_installed_checks_requirements(tmp_path):
    assert is_installed._satisfied("pytest>=8")
    assert not is_installed._satisfied("pytest<1")
    assert not is_installed._satisfied("no-such-package-pdserve-test")
    assert is_installed._satisfied("no-such-package-pdserve-test; platform_system == 'Plan9'")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "pdserve"\nversion = "0"\n')
    assert is_installed.missing([], root=tmp_path) == [f"pdserve (editable, from {tmp_path})"]


def test_readme_setup_and_ci_agree():
    readme = (ROOT / "README.md").read_text()
    serve = 'bash scripts/setup.sh && pdserve generate --chat --prompt "What is the capital of'
    test = "bash scripts/setup.sh --test && python -m pytest -q"
    assert serve in readme and f"\n{test}\n" in readme
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [test]
    bad = subprocess.run(["bash", str(ROOT / "scripts/setup.sh"), "--bogus"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--bogus" in bad.stderr



def _setup(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts/setup.sh"), *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_setup_refuses_a_python_that_forbids_pip_installs(tmp_path):
    """A system Python marked EXTERNALLY-MANAGED (Debian's): setup.sh says to make a virtual
    environment, before installing anything."""
    fake = tmp_path / "python3"  # a Python whose stdlib folder carries the marker
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    (stdlib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\n")
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c '\nimport sys, sysconfig\n"
                    f"sysconfig.get_path = lambda name: \"{stdlib}\"\n"
                    "sys.base_prefix = sys.prefix\nexec(sys.argv[1])' \"$2\"\n")
    fake.chmod(0o755)
    done = _setup(PYTHON=str(fake))
    assert done.returncode == 2 and "virtual environment" in done.stderr, done.stderr
    # pip told to install there anyway: past the check (the fake runs only `-c` code, so
    # every later step finds its part installed)
    allowed = _setup(PYTHON=str(fake), PIP_BREAK_SYSTEM_PACKAGES="1")
    assert allowed.returncode == 0 and "virtual environment" not in allowed.stderr
    old = tmp_path / "old-python"
    old.write_text("#!/bin/sh\nexit 1\n")  # fails the version check
    old.chmod(0o755)
    done = _setup(PYTHON=str(old))
    assert done.returncode == 2 and "3.11" in done.stderr


def test_setup_says_when_another_torch_build_is_installed():
    import torch

    other = "--cpu" if torch.version.cuda else "--gpu"
    done = _setup(other)
    assert done.returncode == 2 and "uninstall" in done.stderr, done.stderr
