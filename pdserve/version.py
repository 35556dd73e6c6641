"""pdserve's version: the installed distribution's, else the source tree's pyproject.toml."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

UNKNOWN = "0+unknown"  # neither installed nor next to its pyproject.toml
_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def version() -> str:
    """The version in pdserve's package metadata; from a source tree that was never
    installed, `project.version` of its pyproject.toml."""
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return pyproject_version()


def pyproject_version(path: Path = _PYPROJECT) -> str:
    """`project.version` of the pyproject.toml at `path` (UNKNOWN when unreadable)."""
    try:
        return str(tomllib.loads(path.read_text())["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return UNKNOWN
