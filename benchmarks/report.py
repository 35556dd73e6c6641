"""How a benchmark hands in its result: JSON on stdout, and in `--out` when given."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
