"""Where pdserve keeps what it works out once per machine (native kernels, converted GGUF
tokenizers, remembered model facts): $PDSERVE_CACHE_DIR, else ~/.cache/pdserve."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PDSERVE_CACHE_DIR"


def cache_dir() -> Path:
    """The cache folder (not created here)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdserve")
