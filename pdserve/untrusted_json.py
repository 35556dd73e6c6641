"""JSON from another process or a client: `json.loads`, but every malformed input, nesting
too deep for Python's parser included, raises ValueError (json.loads raises RecursionError
for `[[[[...` a few thousand levels deep, which no caller's `except ValueError` catches)."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """Parse `text`; ValueError (JSONDecodeError or UnicodeDecodeError among them) if it is
    not JSON Python can hold."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None
