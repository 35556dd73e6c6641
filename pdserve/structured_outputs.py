"""Structured outputs: vLLM's `StructuredOutputsParams`, and the grammar each one stands for.

A request constrains its output with exactly one of: a JSON schema (`json`), any JSON object
(`json_object`), a regular expression (`regex`), one of several strings (`choice`), an EBNF
grammar (`grammar`) or an xgrammar structural tag (`structural_tag`). The constraint is checked
where it is made (a malformed schema, regex or grammar is a ValueError naming the field), and
`GrammarSpec` is its canonical, hashable form: what crosses processes and keys the compile cache.
The grammar engine is xgrammar, imported on first use.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pdserve import untrusted_json

if TYPE_CHECKING:
    import xgrammar

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# What one constraint may hold: a grammar engine's compile time grows steeply with schema
# nesting (about 3 s at 225 levels, 13 s at 450) and with long choice lists (6 s for 20,000),
# and a compile holds up the constrained requests queued behind it.
MAX_SCHEMA_DEPTH = 64  # JSON nesting: about 32 levels of nested object schemas
MAX_SCHEMA_NODES = 20_000  # objects, arrays and values in one schema
MAX_CHOICES = 4096
# Source sizes: compile time grows with them too (a 250 KB regex took 20 s, 1 MB over 99 s;
# 64 KB about 0.2 s, a 256 KB schema of enums about 1 s).
MAX_CONSTRAINT_BYTES = 64 << 10  # a regex, grammar or structural tag; all choices together
MAX_SCHEMA_BYTES = 256 << 10  # a JSON schema, as compact JSON
# Text that no grammar holds (a string under one of these keys is not counted).
_ANNOTATIONS = frozenset({"description", "title", "$comment"})
# xgrammar prefixes its errors with "[time] file.cc:line: ".
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint in canonical form: `kind` among json, json_object, regex, choice,
    grammar, structural_tag; `source` its text (a schema as JSON, choices as a JSON list)."""

    kind: str
    source: str
    any_whitespace: bool = True


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's fields; exactly one kind is set).

    `json` takes a schema as a dict or JSON text. `disable_any_whitespace` makes JSON compact;
    `disable_additional_properties` forbids properties a schema does not list.
    `disable_fallback` and `whitespace_pattern` are accepted for compatibility: there is one
    grammar engine, and its whitespace rule is fixed.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    _spec: GrammarSpec | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        chosen = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if not chosen:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar, "
                             "json_object or structural_tag must be set, got none")
        if len(chosen) > 1:
            raise ValueError(f"structured_outputs: only one kind of constraint may be set, "
                             f"got {', '.join(chosen)}")
        self._spec = self._make_spec(chosen[0])
        check_grammar(self._spec)

    @classmethod
    def from_dict(cls, values: Any, name: str = "structured_outputs") -> StructuredOutputsParams:
        """From a request body's dict; unknown keys are a ValueError naming them."""
        if isinstance(values, StructuredOutputsParams):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"{name}: expected an object, got {type(values).__name__}")
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{name}: unknown field(s) {', '.join(unknown)}")
        return cls(**values)

    @property
    def spec(self) -> GrammarSpec:
        assert self._spec is not None
        return self._spec

    def _make_spec(self, kind: str) -> GrammarSpec:
        value = getattr(self, kind)
        any_ws = not self.disable_any_whitespace
        if kind == "json":
            schema = _schema(value)
            _check_size(schema)
            if self.disable_additional_properties:
                schema = _no_additional_properties(schema)
            return GrammarSpec("json", _sized("json", json.dumps(schema, sort_keys=True),
                                              MAX_SCHEMA_BYTES), any_ws)
        if kind == "json_object":
            return GrammarSpec("json_object", "", any_ws)
        if kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) for c in value)):
                raise ValueError(f"structured_outputs.choice: expected a non-empty list of "
                                 f"strings, got {str(value)[:80]}")
            if len(value) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice: at most {MAX_CHOICES} choices, "
                                 f"got {len(value)}")
            return GrammarSpec("choice", _sized("choice", json.dumps(list(value),
                                                                     ensure_ascii=False)))
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind}: expected a non-empty string, "
                             f"got {str(value)[:80]!r}")
        return GrammarSpec(kind, _sized(kind, value))


def _sized(kind: str, source: str, limit: int = MAX_CONSTRAINT_BYTES) -> str:
    """`source`, or ValueError naming the field when its UTF-8 form is over `limit` bytes."""
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ValueError(f"structured_outputs.{kind}: at most {limit} bytes, got {size}")
    return source


def _schema(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = untrusted_json.loads(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs.json: a JSON schema must be an object, "
                         f"got {type(value).__name__}")
    return value


def _check_size(schema: dict) -> None:
    """ValueError naming the field when the schema nests deeper than MAX_SCHEMA_DEPTH or holds
    more than MAX_SCHEMA_NODES values (walked without recursion)."""
    nodes, stack = 0, [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH or nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"structured_outputs.json: the schema nests deeper than "
                             f"{MAX_SCHEMA_DEPTH} levels or holds more than "
                             f"{MAX_SCHEMA_NODES} values")
        children = [v for k, v in value.items()
                    if not (k in _ANNOTATIONS and isinstance(v, str))] \
            if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)


def _no_additional_properties(schema: Any) -> Any:
    """A copy of `schema` where every object schema forbids unlisted properties."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out["additionalProperties"] = False
    return out


def is_constraint_error(error: str) -> bool:
    """A request's error caused by its own structured_outputs constraint, or by output tokens
    it came with that the constraint refuses (a client error: HTTP 400 / INVALID_ARGUMENT),
    not by the server."""
    return error.startswith(("structured_outputs", "output_token_ids"))


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def xgrammar_message(error: Exception) -> str:
    """xgrammar's error text without its source-location prefix."""
    return _XGRAMMAR_PREFIX.sub("", str(error)).strip().splitlines()[0] if str(error) else ""


@functools.lru_cache(maxsize=1024)
def check_grammar(spec: GrammarSpec) -> None:
    """ValueError naming the field when xgrammar cannot read the constraint (cached)."""
    build_grammar(spec)


def build_grammar(spec: GrammarSpec) -> xgrammar.Grammar:
    """The xgrammar Grammar of a constraint (no tokenizer needed)."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=spec.any_whitespace)
        if spec.kind == "json_object":  # any JSON object, as OpenAI's json_object mode
            return xgr.Grammar.from_json_schema('{"type": "object"}',
                                                any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.source)))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.source)
        return _structural_tag(xgr, spec.source)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError and its own error types
        raise ValueError(f"structured_outputs.{spec.kind}: invalid {_NOUNS[spec.kind]}: "
                         f"{xgrammar_message(e)}") from e


_NOUNS = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
          "choice": "choice list", "grammar": "EBNF grammar", "structural_tag": "structural tag"}


def _structural_tag(xgr, source: str) -> xgrammar.Grammar:
    """vLLM's two structural-tag forms: {"structures": [{begin, schema, end}], "triggers"}
    and xgrammar's {"type": "structural_tag", "format": ...}."""
    try:
        tag = untrusted_json.loads(source)
    except ValueError as e:
        raise ValueError(f"structured_outputs.structural_tag: not valid JSON ({e})") from e
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                       end=s["end"]) for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", [])))
    return xgr.Grammar.from_structural_tag(source)
