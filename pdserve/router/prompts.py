"""The prompt of a router request (GenerateRequest, EmbedRequest): text or token ids."""

from __future__ import annotations

from collections.abc import Callable


def prompt_ids(request, encode: Callable[[str], list[int]]) -> list[int]:
    """The token ids of a request's `prompt` oneof (text is tokenized with `encode`); raises
    ValueError naming the field when it is unset, empty or holds a negative id."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        ids = encode(request.text) if request.text else []
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
    else:
        raise ValueError("prompt: set text or token_ids")
    if not ids:
        raise ValueError(f"prompt: must not be empty ({kind})")
    bad = next((t for t in ids if t < 0), None)
    if bad is not None:
        raise ValueError(f"prompt.token_ids: token id {bad} is negative")
    return ids
