"""Which torch build to install here: prints the `pip install` arguments, one per line.

    python scripts/choose_torch.py [--gpu | --cpu] [--version V]

On a machine with an NVIDIA driver (`nvidia-smi` runs, or /proc/driver/nvidia exists): PyTorch's
CUDA build from the default index, which brings the triton it was built with. Elsewhere the CPU
build: from the default index when that gives a CPU build (pip set up to find one, or a platform
where PyPI's torch is CPU-only), else from PyTorch's CPU index; if that index cannot be reached,
a note on stderr and the default index. --gpu / --cpu skip the detection. scripts/setup.sh
installs what this prints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass

TORCH_VERSION = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 120  # a dry-run resolution of torch alone, from the default index


@dataclass(frozen=True)
class Choice:
    """The pip arguments, and what to tell the user about them (None: nothing)."""

    args: list[str]
    note: str | None = None


def has_nvidia_driver(proc_path: str = "/proc/driver/nvidia") -> bool:
    """True when an NVIDIA driver is loaded: /proc/driver/nvidia exists or nvidia-smi runs."""
    if os.path.exists(proc_path):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def is_cuda_build(version: str, requires_dist: list[str]) -> bool:
    """Whether a torch distribution (its version and Requires-Dist) is a CUDA build."""
    if "+cu" in version:
        return True
    return any(r.lower().startswith(("nvidia-", "cuda-")) for r in requires_dist)


def default_index_torch(version: str = TORCH_VERSION) -> tuple[str, list[str]] | None:
    """The torch the default index (with this machine's pip settings) would install: its
    version and Requires-Dist, from a dry run (nothing is downloaded but metadata); None
    when pip cannot tell (no network, a pip without --dry-run --report)."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
           "--quiet", "--disable-pip-version-check", "--report", "-", f"torch=={version}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        report = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return None
    for item in (report or {}).get("install", []):
        meta = item.get("metadata", {})
        if meta.get("name", "").lower() == "torch":
            return meta.get("version", ""), list(meta.get("requires_dist") or [])
    return None


def reachable(url: str, timeout_s: float = 10.0) -> bool:
    """Whether an HTTP GET of `url` answers at all."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return True
    except OSError:
        return False


def choose(gpu: bool, default_is_cpu: bool | None, cpu_index_ok: bool,
           version: str = TORCH_VERSION) -> Choice:
    """The decision, from the facts: an NVIDIA driver here (`gpu`); whether the default index
    gives a CPU build (None: unknown); whether PyTorch's CPU index answers."""
    if gpu:
        # "===": exactly the plain version, PyPI's CUDA build; a local "+cpu" wheel that pip
        # may be set up to find (find-links) would otherwise win, its version sorting higher.
        return Choice([f"torch==={version}"])
    pin = f"torch=={version}"
    if default_is_cpu:
        return Choice([pin])
    if cpu_index_ok:
        return Choice(["--index-url", CPU_INDEX, pin])
    return Choice([pin], f"note: {CPU_INDEX} cannot be reached; installing torch {version} "
                         "from the default index instead (on Linux that is the CUDA build, "
                         "several GB)")


def detect(version: str = TORCH_VERSION) -> tuple[bool | None, bool]:
    """For a CPU machine: (does the default index give a CPU build, is the CPU index up)."""
    found = default_index_torch(version)
    if found is not None and not is_cuda_build(*found):
        return True, False  # the default is fine: no need to ask the CPU index
    return (None if found is None else False), reachable(f"{CPU_INDEX}/torch/")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--gpu", action="store_true", help="the CUDA build, whatever is here")
    kind.add_argument("--cpu", action="store_true", help="the CPU build, whatever is here")
    parser.add_argument("--version", default=TORCH_VERSION, help="the torch version")
    args = parser.parse_args(argv)
    gpu = args.gpu or (not args.cpu and has_nvidia_driver())
    default_is_cpu, cpu_index_ok = (None, False) if gpu else detect(args.version)
    choice = choose(gpu, default_is_cpu, cpu_index_ok, args.version)
    if choice.note:
        print(choice.note, file=sys.stderr)
    print("\n".join(choice.args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
