"""The structured-outputs constraint an HTTP request asks for, from whichever field it used:
OpenAI's `response_format`, vLLM's `structured_outputs` extra field, the older `guided_*`
fields, or a chat's `tool_choice` ("required" or a named function). At most one may be used."""

from __future__ import annotations

import json
from typing import Any

from pdserve.gateway.protocol import APIError, bad_request
from pdserve.structured_outputs import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _from_response_format(rf) -> dict[str, Any] | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema: a schema is required when type "
                              "is json_schema", "response_format")
        return {"json": rf.json_schema.schema_}
    tag = ({"format": rf.format, "type": "structural_tag"} if rf.format is not None
           else {"structures": rf.structures or [], "triggers": rf.triggers or []})
    return {"structural_tag": json.dumps(tag)}


def requested_constraint(req, tool_schema: dict | None = None) -> StructuredOutputsParams | None:
    """The request's constraint, or None; APIError 400 naming the field when it is bad or
    when two fields ask for one."""
    asked: list[tuple[str, Any]] = []
    if getattr(req, "response_format", None) is not None:
        values = _from_response_format(req.response_format)
        if values is not None:
            asked.append(("response_format", values))
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", req.structured_outputs))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            asked.append((name, {kind: value}))
    if tool_schema is not None:  # compact: arguments are for programs, not readers
        asked.append(("tool_choice", {"json": tool_schema, "disable_any_whitespace": True}))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad_request(f"{asked[1][0]}: only one field may constrain the output, got {names}",
                          asked[1][0])
    name, values = asked[0]
    try:
        return StructuredOutputsParams.from_dict(values, name)
    except (ValueError, TypeError) as e:
        message = str(e)
        if not message.startswith(name):
            message = f"{name}: {message}"
        raise APIError(400, message, param=name) from e
