"""Structured outputs asked for over HTTP (response_format, structured_outputs, guided_*,
tools and tool_choice) as SamplingParams constraints, and tool-call messages as chat templates
read them. No model weights needed."""

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
from pdserve.structured_outputs import GrammarSpec

from structured_fixtures import SCHEMA, STRUCTURAL_TAG


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
