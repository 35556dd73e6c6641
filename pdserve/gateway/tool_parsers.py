"""Tool calls in generated chat text: the "auto" parsers (`--tool-call-parser`) and the helpers
for tool_choice "required" or a named function.

A parser turns a model's output into OpenAI tool calls, either at once (`parse`) or while it
streams (`feed` / `finish`, which return chat.completion.chunk delta dicts). `parse` runs the
streaming machine over the whole text, so both ways give the same result. Malformed tool-call
JSON is never an error: that text is returned as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve import untrusted_json

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    """One function call; `arguments` is a JSON object serialized as a string."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The call in OpenAI's `tool_calls` item shape."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    """A whole output split into content (None when empty) and tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id."""
    return "call_" + uuid.uuid4().hex[:24]


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _call_from(obj: Any, keys: tuple[str, ...]) -> tuple[str, dict] | None:
    """(name, arguments) from a decoded `{"name": ..., <key>: {...}}`, or None if malformed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in keys if k in obj), None)
    args = {} if key is None else obj[key]
    if isinstance(args, str):  # some models send the arguments already serialized
        try:
            args = untrusted_json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _partial_marker(buf: str, marker: str) -> int:
    """Length of the longest end of `buf` that could be the start of `marker`."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


class ToolParser:
    """Base of the parsers: content emission (outer whitespace dropped) and call bookkeeping."""

    name = ""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._started = False  # some non-space content was emitted
        self._ws = ""  # trailing whitespace held back: it is dropped if nothing follows

    @property
    def called(self) -> bool:
        """True once any tool call was emitted."""
        return bool(self.calls)

    def parse(self, text: str) -> ParsedMessage:
        """Parse a whole output (non-streaming); does not touch this parser's stream state."""
        fresh = type(self)()
        deltas = fresh.feed(text) + fresh.finish()
        content = "".join(d["content"] for d in deltas if "content" in d)
        return ParsedMessage(content or None, list(fresh.calls))

    def feed(self, delta_text: str) -> list[dict]:
        """Take the next piece of output; return the delta dicts that can be sent now."""
        raise NotImplementedError

    def finish(self) -> list[dict]:
        """The output ended: return the delta dicts for whatever is left."""
        raise NotImplementedError

    def _text(self, s: str, out: list[dict]) -> None:
        if not self._started:
            s = s.lstrip()
            if not s:
                return
            self._started = True
        s = self._ws + s
        body = s.rstrip()
        self._ws = s[len(body):]
        if body:
            out.append({"content": body})

    def _call(self, name: str, args: dict, out: list[dict]) -> None:
        call = ToolCall(new_call_id(), name, _dump(args))
        out.append({"tool_calls": [{"index": len(self.calls), **call.to_openai()}]})
        self.calls.append(call)


class HermesToolParser(ToolParser):
    """Hermes / Qwen: content, then `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks. The first malformed block turns it and all that follows into content."""

    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"  # text | block | between | plain
        # Inside a block, text that cannot hold the closing tag waits here, joined once the
        # tag comes: appending each delta to one string would copy it again every time.
        self._pending: list[str] = []
        self._tail = ""  # the last len(HERMES_CLOSE) - 1 characters of the block so far

    def feed(self, delta_text: str) -> list[dict]:
        out: list[dict] = []
        if self._state == "block":
            if not self._pending:
                self._tail = self._buf[1 - len(HERMES_CLOSE):]
            window = self._tail + delta_text
            if HERMES_CLOSE not in window:
                self._pending.append(delta_text)
                self._tail = window[1 - len(HERMES_CLOSE):]
                return out
        self._buf += "".join(self._pending) + delta_text
        self._pending = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[dict]) -> bool:
        """Consume what can be decided in the buffer; True if it should run again."""
        buf, state = self._buf, self._state
        if state == "plain":
            self._text(buf, out)
            self._buf = ""
            return False
        if state == "block":
            j = buf.find(HERMES_CLOSE)
            if j < 0:
                return False
            self._buf = buf[j + len(HERMES_CLOSE):]
            self._block(buf[:j], HERMES_OPEN + buf[:j + len(HERMES_CLOSE)], out)
            return True
        i = buf.find(HERMES_OPEN)
        if i >= 0:
            if state == "text":
                self._text(buf[:i], out)
            self._buf, self._state = buf[i + len(HERMES_OPEN):], "block"
            return True
        keep = _partial_marker(buf, HERMES_OPEN)
        if state == "text":
            self._text(buf[:len(buf) - keep], out)
        self._buf = buf[len(buf) - keep:]
        return False

    def _block(self, body: str, raw: str, out: list[dict]) -> None:
        try:
            call = _call_from(untrusted_json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            self._state = "plain"
            self._text(raw, out)
        else:
            self._state, self._ws = "between", ""
            self._call(*call, out)

    def finish(self) -> list[dict]:
        out: list[dict] = []
        buf, self._buf = self._buf + "".join(self._pending), ""
        self._pending = []
        if self._state in ("text", "plain"):
            self._text(buf, out)
        elif self._state == "block":  # the output ended inside a block
            self._block(buf, HERMES_OPEN + buf, out)
        self._ws = ""
        return out


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x: the whole output (after an optional `<|python_tag|>`) is one JSON call
    `{"name": ..., "parameters": {...}}` or several separated by `;`; else it is content."""

    name = "llama3_json"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # start | json | plain

    def feed(self, delta_text: str) -> list[dict]:
        out: list[dict] = []
        self._buf += delta_text
        if self._mode == "start":
            head = self._buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return out
            self._mode = "json" if head.startswith(("{", PYTHON_TAG)) else "plain"
        if self._mode == "plain":
            self._text(self._buf, out)
            self._buf = ""
        return out

    def finish(self) -> list[dict]:
        out: list[dict] = []
        buf, self._buf = self._buf, ""
        calls = _llama_calls(buf) if self._mode == "json" else None
        if calls is None:
            self._text(buf, out)
        else:
            for call in calls:
                self._call(*call, out)
        self._ws = ""
        return out


def _llama_calls(text: str) -> list[tuple[str, dict]] | None:
    """The calls of a Llama 3 JSON output, or None if any part is malformed."""
    text = text.strip().removeprefix(PYTHON_TAG)
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        pos = _SPACE.match(text, pos).end()
        if pos == len(text):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # RecursionError: nested beyond the stack
            return None
        call = _call_from(obj, ("parameters", "arguments"))
        pos = _SPACE.match(text, pos).end()
        if call is None or text[pos:pos + 1] not in ("", ";"):
            return None
        calls.append(call)
        pos += 1


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """A new parser of the given `--tool-call-parser` name."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} "
                         f"(choose {', '.join(TOOL_PARSERS)})")
    return TOOL_PARSERS[name]()


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_tools_schema(tools: list[dict]) -> dict:
    """JSON schema of a non-empty array of `{"name": ..., "parameters": {...}}` calls."""
    return {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [{
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        } for t in tools]},
    }


def parse_required(text: str) -> list[ToolCall]:
    """The calls of an output generated under `required_tools_schema`; ValueError if bad."""
    try:
        items = untrusted_json.loads(text)
    except ValueError as e:
        raise ValueError(f"tool_calls: output is not valid JSON ({e})") from None
    if not isinstance(items, list) or not items:
        raise ValueError("tool_calls: output is not a non-empty JSON array")
    calls = []
    for item in items:
        call = _call_from(item, ("parameters", "arguments"))
        if call is None:
            raise ValueError(f"tool_calls: malformed call {_dump(item)}")
        calls.append(ToolCall(new_call_id(), call[0], _dump(call[1])))
    return calls


def named_tool_call(name: str, text: str) -> ToolCall:
    """The call of an output that is the named function's arguments object."""
    try:
        args = _dump(untrusted_json.loads(text))
    except ValueError:
        args = text
    return ToolCall(new_call_id(), name, args)


def validate_tools(tools: Any, tool_choice: Any) -> None:
    """Check the request's `tools` and `tool_choice`; ValueError naming the field if wrong."""
    names: set[str] = set()
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError("tools: must be a list of function tools")
        for i, tool in enumerate(tools):
            ok = isinstance(tool, dict) and tool.get("type") == "function"
            fn = tool.get("function") if ok else None
            if not isinstance(fn, dict):
                raise ValueError(f'tools: item {i} is not {{"type": "function", '
                                 f'"function": {{...}}}}')
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools: item {i} has no function name")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise ValueError(f"tools: parameters of function {fn['name']!r} "
                                 "must be a JSON schema object")
            if fn["name"] in names:
                raise ValueError(f"tools: function {fn['name']!r} is defined twice")
            names.add(fn["name"])
    if tool_choice is None or tool_choice == "none":
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    named = isinstance(fn, dict) and isinstance(fn.get("name"), str) \
        and tool_choice.get("type") == "function"
    if not named and tool_choice not in ("auto", "required"):
        raise ValueError('tool_choice: must be "none", "auto", "required" or {"type": '
                         f'"function", "function": {{"name": ...}}}}, not {tool_choice!r}')
    if not names:
        raise ValueError(f'tool_choice: {tool_choice!r} needs tools (or use "none")')
    if named and fn["name"] not in names:
        raise ValueError(f"tool_choice: function {fn['name']!r} is not among the tools")
