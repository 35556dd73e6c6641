"""Exit 0 when pdserve is installed from this checkout with everything pyproject.toml asks
for (and the given extras), 1 otherwise: scripts/setup.sh then skips `pip install -e`.

    python scripts/is_installed.py [EXTRA ...]
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import tomllib
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def missing(extras: list[str], root: Path = ROOT) -> list[str]:
    """What is not installed as pyproject.toml at `root` asks: pdserve itself (from `root`, at
    its version) and each requirement of the project and of `extras` that applies here."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    spec = importlib.util.find_spec("pdserve")
    if spec is None or Path(spec.origin or "").resolve() != root / "pdserve" / "__init__.py":
        return [f"pdserve (editable, from {root})"]
    try:
        if importlib.metadata.version("pdserve") != project["version"]:
            return [f"pdserve=={project['version']}"]
    except importlib.metadata.PackageNotFoundError:
        return ["pdserve"]
    wanted = list(project.get("dependencies", []))
    for extra in extras:
        wanted += project.get("optional-dependencies", {}).get(extra, [f"<extra {extra}>"])
    return [text for text in wanted if not _satisfied(text)]


def _satisfied(text: str) -> bool:
    try:
        req = Requirement(text)
    except ValueError:
        return False
    if req.marker is not None and not req.marker.evaluate():
        return True
    try:
        return req.specifier.contains(importlib.metadata.version(req.name), prereleases=True)
    except importlib.metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(1 if missing(sys.argv[1:]) else 0)
