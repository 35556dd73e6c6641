"""Structured outputs: StructuredOutputsParams and GrammarSpec (checked by the real xgrammar),
their place in SamplingParams and the proto wire form. No model weights needed (the HTTP
fields: test_structured_outputs_http.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.sampling_params import SamplingParams
from pdserve.services.convert import (
    params_from_proto,
    params_to_proto,
    structured_from_proto,
    structured_to_proto,
)
from pdserve.structured_outputs import GrammarSpec, StructuredOutputsParams

from structured_fixtures import SCHEMA, STRUCTURAL_TAG


# One valid constructor argument per kind, and the spec kind it must give.
KINDS = {
    "json_dict": ({"json": SCHEMA}, "json"),
    "json_text": ({"json": json.dumps(SCHEMA)}, "json"),
    "regex": ({"regex": r"[a-z]+\d{2}"}, "regex"),
    "choice": ({"choice": ["yes", "no", "maybe"]}, "choice"),
    "grammar": ({"grammar": 'root ::= "a" | "b"'}, "grammar"),
    "json_object": ({"json_object": True}, "json_object"),
    "structural_tag": ({"structural_tag": json.dumps(STRUCTURAL_TAG)}, "structural_tag"),
}

# --- StructuredOutputsParams -------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(KINDS))
def test_each_kind_is_accepted(case):
    values, kind = KINDS[case]
    p = StructuredOutputsParams(**values)
    assert p.spec.kind == kind
    assert p.spec.any_whitespace is True
    hash(p.spec)


def test_json_dict_and_text_give_the_same_spec():
    as_dict = StructuredOutputsParams(json=SCHEMA).spec
    as_text = StructuredOutputsParams(json=json.dumps(SCHEMA)).spec
    assert as_dict == as_text
    assert json.loads(as_dict.source) == SCHEMA


def test_choice_and_json_object_sources():
    assert json.loads(StructuredOutputsParams(choice=["yes", "no"]).spec.source) == ["yes", "no"]
    assert StructuredOutputsParams(json_object=True).spec == GrammarSpec("json_object", "")
    assert StructuredOutputsParams(regex="ab+").spec == GrammarSpec("regex", "ab+")


def test_no_kind_is_an_error():
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(json_object=False)


def test_two_kinds_is_an_error_naming_both():
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(regex="a+", choice=["a"])
    message = str(info.value)
    assert "regex" in message and "choice" in message


@pytest.mark.parametrize("values, field", [
    ({"json": '{"type": "object",'}, "json"),
    ({"json": "[1, 2]"}, "json"),
    ({"json": {"type": "no_such_type"}}, "json"),
    ({"regex": "(abc"}, "regex"),
    ({"regex": ""}, "regex"),
    ({"grammar": 'root ::= "a" |'}, "grammar"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 1]}, "choice"),
    ({"choice": "ab"}, "choice"),
    ({"structural_tag": "{not json"}, "structural_tag"),
])
def test_malformed_constraint_names_the_field(values, field):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**values)
    assert str(info.value).startswith(f"structured_outputs.{field}"), str(info.value)


def test_from_dict():
    p = StructuredOutputsParams.from_dict({"regex": "a+", "disable_any_whitespace": True})
    assert p.spec == GrammarSpec("regex", "a+")
    assert StructuredOutputsParams.from_dict(p) is p


def test_from_dict_unknown_key_is_named():
    with pytest.raises(ValueError, match="bogus_key"):
        StructuredOutputsParams.from_dict({"regex": "a+", "bogus_key": 1})
    with pytest.raises(ValueError, match="guided_regex"):
        StructuredOutputsParams.from_dict({"regex": "a+", "guided_regex": "b"}, "guided_regex")
    with pytest.raises(ValueError, match="expected an object"):
        StructuredOutputsParams.from_dict(["regex"])


def test_disable_additional_properties_reaches_nested_objects():
    spec = StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True).spec
    schema = json.loads(spec.source)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["address"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["name"]
    # The caller's schema is left alone, and without the flag nothing is added.
    assert "additionalProperties" not in SCHEMA
    plain = json.loads(StructuredOutputsParams(json=SCHEMA).spec.source)
    assert "additionalProperties" not in plain


def test_disable_any_whitespace():
    assert StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).spec.any_whitespace \
        is False
    assert StructuredOutputsParams(json_object=True,
                                   disable_any_whitespace=True).spec.any_whitespace is False
    assert StructuredOutputsParams(json=SCHEMA).spec.any_whitespace is True


def test_equal_constraints_give_equal_hashable_specs():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"]})
    b = StructuredOutputsParams(json='{"required": ["a"], "properties": {"a": {"type": '
                                     '"integer"}}, "type": "object"}')
    assert a.spec == b.spec and hash(a.spec) == hash(b.spec)
    assert len({a.spec, b.spec, StructuredOutputsParams(regex="a").spec}) == 2
    assert StructuredOutputsParams(choice=["x", "y"]).spec \
        != StructuredOutputsParams(choice=["y", "x"]).spec
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).spec
    assert compact != StructuredOutputsParams(json=SCHEMA).spec


# --- SamplingParams -----------------------------------------------------------------------


def test_sampling_params_converts_a_dict():
    p = SamplingParams(max_tokens=8, structured_outputs={"choice": ["a", "b"]})
    assert isinstance(p.structured_outputs, StructuredOutputsParams)
    assert p.structured_outputs.spec.kind == "choice"
    assert SamplingParams(max_tokens=8).structured_outputs is None


@pytest.mark.parametrize("bad", [{"regex": "(abc"}, {"bogus": 1}, {}])
def test_sampling_params_rejects_a_bad_constraint(bad):
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(max_tokens=8, structured_outputs=bad)


def test_sampling_params_clone_keeps_the_constraint():
    p = SamplingParams(max_tokens=8, structured_outputs={"json": SCHEMA,
                                                         "disable_any_whitespace": True})
    q = p.clone()
    assert isinstance(q.structured_outputs, StructuredOutputsParams)
    assert q.structured_outputs.spec == p.structured_outputs.spec
    assert q.structured_outputs.spec.any_whitespace is False


# --- proto --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(KINDS))
@pytest.mark.parametrize("compact", [False, True])
def test_proto_round_trip_keeps_the_spec(case, compact):
    values, kind = KINDS[case]
    so = StructuredOutputsParams(**values, disable_any_whitespace=compact)
    p = SamplingParams(max_tokens=8, temperature=0.5, structured_outputs=so)
    msg = params_to_proto(p)
    assert msg.HasField("structured_outputs")
    assert msg.structured_outputs.WhichOneof("kind") == kind
    wire = common_pb2.SamplingParams.FromString(msg.SerializeToString())
    back = params_from_proto(wire)
    assert isinstance(back.structured_outputs, StructuredOutputsParams)
    assert back.structured_outputs.spec == so.spec
    assert back.max_tokens == 8


def test_proto_keeps_disable_additional_properties_in_the_schema():
    so = StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True)
    back = structured_from_proto(structured_to_proto(so))
    assert back.spec == so.spec
    assert json.loads(back.spec.source)["properties"]["address"]["additionalProperties"] is False


def test_proto_without_a_constraint():
    msg = params_to_proto(SamplingParams(max_tokens=8))
    assert not msg.HasField("structured_outputs")
    assert params_from_proto(msg).structured_outputs is None


def test_proto_with_no_kind_is_an_error():
    with pytest.raises(ValueError, match="structured_outputs"):
        structured_from_proto(common_pb2.StructuredOutputs())
    msg = common_pb2.SamplingParams(max_tokens=4)
    msg.structured_outputs.CopyFrom(common_pb2.StructuredOutputs(disable_any_whitespace=True))
    assert msg.HasField("structured_outputs")
    with pytest.raises(ValueError, match="structured_outputs"):
        params_from_proto(msg)


def test_proto_with_a_malformed_regex_is_an_error():
    msg = common_pb2.SamplingParams(max_tokens=4)
    msg.structured_outputs.regex = "(abc"
    with pytest.raises(ValueError) as info:
        params_from_proto(msg)
    assert "structured_outputs.regex" in str(info.value)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("kwargs, field", [
    ({"json": _nested(40)}, "structured_outputs.json"),
    ({"json": _nested(300), "disable_additional_properties": True}, "structured_outputs.json"),
    ({"json": {"enum": list(range(30_000))}}, "structured_outputs.json"),
    ({"choice": [f"c{i}" for i in range(5000)]}, "structured_outputs.choice"),
    ({"choice": ["x" * 20_000] * 4}, "structured_outputs.choice"),  # 4 choices, 80 KB
    ({"regex": "a" * (64 << 10) + "b"}, "structured_outputs.regex"),
    ({"grammar": 'root ::= "' + "é" * (32 << 10) + '"'}, "structured_outputs.grammar"),
    ({"json": {"type": "object", "description": "d" * (256 << 10)}},
     "structured_outputs.json"),
])
def test_constraints_too_big_to_compile_quickly_are_refused_naming_the_field(kwargs, field):
    """A grammar's compile time grows steeply with schema nesting and choice count, and a
    compile holds up the constrained requests behind it: such constraints are refused
    before anything is compiled."""
    with pytest.raises(ValueError, match=field):
        StructuredOutputsParams(**kwargs)


def test_constraints_at_the_bounds_are_accepted():
    assert StructuredOutputsParams(json=_nested(30)).spec.kind == "json"
    assert StructuredOutputsParams(choice=[f"c{i}" for i in range(4096)]).spec.kind == "choice"
    assert StructuredOutputsParams(regex="a" * ((64 << 10) - 10)).spec.kind == "regex"
    big = {"type": "object", "description": "d" * (200 << 10)}
    assert StructuredOutputsParams(json=big).spec.kind == "json"
