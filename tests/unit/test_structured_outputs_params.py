"""Structured outputs: StructuredOutputsParams and GrammarSpec (checked by the real xgrammar),
their place in SamplingParams and the proto wire form, the HTTP fields that ask for a
constraint, and tool-call messages as chat templates read them. No model weights needed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.engine.llm import _text_message
from pdserve.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ToolCallMessage,
)
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.sampling_params import SamplingParams
from pdserve.services.convert import (
    params_from_proto,
    params_to_proto,
    structured_from_proto,
    structured_to_proto,
)
from pdserve.structured_outputs import GrammarSpec, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    "required": ["name"],
}

STRUCTURAL_TAG = {
    "structures": [{"begin": "<function=get_weather>",
                    "schema": {"type": "object", "properties": {"city": {"type": "string"}}},
                    "end": "</function>"}],
    "triggers": ["<function="],
}

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

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]

USER = [{"role": "user", "content": "hi"}]


def chat(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=USER, **kwargs)


def api_error(request) -> APIError:
    with pytest.raises(APIError) as info:
        request.sampling_params(16)
    return info.value


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


# --- HTTP fields --------------------------------------------------------------------------


def test_response_format_json_schema():
    req = chat(response_format={"type": "json_schema",
                                "json_schema": {"name": "person", "schema": SCHEMA}})
    spec = req.sampling_params(16).structured_outputs.spec
    assert spec.kind == "json"
    assert json.loads(spec.source) == SCHEMA


def test_response_format_json_object_and_text():
    spec = chat(response_format={"type": "json_object"}).sampling_params(16) \
        .structured_outputs.spec
    assert spec.kind == "json_object"
    assert chat(response_format={"type": "text"}).sampling_params(16).structured_outputs is None
    assert chat().sampling_params(16).structured_outputs is None


def test_response_format_json_schema_without_a_schema():
    for rf in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
        err = api_error(chat(response_format=rf))
        assert err.status == 400
        assert err.param == "response_format"


def test_response_format_bad_schema_is_a_400():
    err = api_error(chat(response_format={"type": "json_schema",
                                          "json_schema": {"schema": {"type": "no_such"}}}))
    assert err.status == 400 and err.param == "response_format"
    assert err.message.startswith("response_format")


def test_response_format_structural_tag():
    req = chat(response_format={"type": "structural_tag", **STRUCTURAL_TAG})
    assert req.sampling_params(16).structured_outputs.spec.kind == "structural_tag"


def test_structured_outputs_extra_field():
    req = chat(structured_outputs={"regex": "[0-9]+"})
    assert req.sampling_params(16).structured_outputs.spec == GrammarSpec("regex", "[0-9]+")
    req = chat(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    spec = req.sampling_params(16).structured_outputs.spec
    assert spec.kind == "json" and spec.any_whitespace is False
    err = api_error(chat(structured_outputs={"regex": "(abc"}))
    assert err.status == 400 and err.param == "structured_outputs"
    assert "structured_outputs.regex" in err.message
    err = api_error(chat(structured_outputs={"regex": "a", "nope": 1}))
    assert err.param == "structured_outputs" and "nope" in err.message


@pytest.mark.parametrize("field, value, kind", [
    ("guided_json", SCHEMA, "json"),
    ("guided_json", json.dumps(SCHEMA), "json"),
    ("guided_regex", "[a-z]+", "regex"),
    ("guided_choice", ["red", "green"], "choice"),
    ("guided_grammar", 'root ::= "a" | "b"', "grammar"),
])
def test_guided_fields(field, value, kind):
    for make in (chat, lambda **kw: CompletionRequest(prompt="hi", **kw)):
        spec = make(**{field: value}).sampling_params(16).structured_outputs.spec
        assert spec.kind == kind
        if kind == "json":
            assert json.loads(spec.source) == SCHEMA


def test_bad_guided_field_is_a_400_naming_it():
    err = api_error(chat(guided_regex="(abc"))
    assert err.status == 400 and err.param == "guided_regex"
    err = api_error(chat(guided_choice=[]))
    assert err.status == 400 and err.param == "guided_choice"


@pytest.mark.parametrize("first, second", [
    ({"guided_regex": "a+"}, {"guided_choice": ["a"]}),
    ({"response_format": {"type": "json_object"}}, {"guided_json": SCHEMA}),
    ({"structured_outputs": {"regex": "a"}}, {"guided_grammar": 'root ::= "a"'}),
])
def test_two_constraint_fields_are_a_400_naming_the_second(first, second):
    err = api_error(chat(**first, **second))
    assert err.status == 400
    (name,) = second
    assert err.param == name
    assert name in err.message and next(iter(first)) in err.message


def test_tool_choice_required_gives_a_list_of_calls_schema():
    req = chat(tools=TOOLS, tool_choice="required")
    spec = req.sampling_params(16).structured_outputs.spec
    assert spec.kind == "json"
    schema = json.loads(spec.source)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "unknown", "parameters": {}}],
                [{"name": "get_weather", "parameters": {}}], {"name": "get_time"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_tool_choice_gives_its_parameters_schema():
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    spec = req.sampling_params(16).structured_outputs.spec
    assert spec.kind == "json"
    assert json.loads(spec.source) == TOOLS[0]["function"]["parameters"]


def test_tool_choice_naming_an_unknown_function():
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    err = api_error(req)
    assert err.status == 400 and err.param == "tool_choice"


def test_tool_choice_required_with_response_format_is_two_constraints():
    req = chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    err = api_error(req)
    assert err.status == 400
    assert err.param == "tool_choice"
    assert "response_format" in err.message


def test_effective_tool_choice():
    assert chat(tools=TOOLS).effective_tool_choice == "auto"
    assert chat().effective_tool_choice == "none"
    assert chat(tools=TOOLS, tool_choice="none").effective_tool_choice == "none"
    # "auto" and "none" ask for no constraint.
    assert chat(tools=TOOLS).sampling_params(16).structured_outputs is None
    assert chat(tools=TOOLS, tool_choice="none").sampling_params(16).structured_outputs is None


def test_completion_request_response_format_json_object():
    req = CompletionRequest(prompt="hi", response_format={"type": "json_object"})
    assert req.sampling_params(16).structured_outputs.spec.kind == "json_object"
    err = api_error(CompletionRequest(prompt="hi", response_format={"type": "json_object"},
                                      guided_regex="a"))
    assert err.status == 400 and err.param == "guided_regex"


# --- tool-call messages -------------------------------------------------------------------


def test_tool_call_message_for_template_parses_arguments():
    call = ToolCallMessage(id="call_1", function={"name": "get_weather",
                                                  "arguments": '{"city": "Paris"}'})
    assert call.for_template() == {"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather",
                                                "arguments": {"city": "Paris"}}}
    loose = ToolCallMessage(function={"name": "f", "arguments": "not json"})
    assert loose.for_template()["function"]["arguments"] == "not json"


def test_chat_message_for_template():
    assistant = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    msg = assistant.for_template()
    assert msg["role"] == "assistant" and msg["content"] == ""
    assert msg["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msg["tool_calls"][0]["id"] == "call_1"
    tool = ChatMessage(role="tool", content="sunny", tool_call_id="call_1")
    assert tool.for_template() == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_text_message_assistant_tool_calls_without_content():
    message = {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    out = _text_message(0, message)
    assert out["role"] == "assistant"
    assert out["tool_calls"][0]["function"] == {"name": "get_weather",
                                                "arguments": {"city": "Paris"}}
    assert out["tool_calls"][0]["id"] == "call_1"
    # The caller's message is not changed.
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    with pytest.raises(ValueError, match=r"messages\[2\]"):
        _text_message(2, {"role": "assistant", "tool_calls": [{"function": {}}]})
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        _text_message(1, {"role": "assistant"})
