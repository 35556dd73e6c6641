"""Tool-call parsing of chat outputs (hermes, llama3_json), whole and streamed, and the helpers
for tool_choice "required" / a named function."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.gateway.tool_parsers import (
    TOOL_PARSERS,
    ParsedMessage,
    ToolCall,
    get_tool_parser,
    named_tool_call,
    parse_required,
    required_tools_schema,
    validate_tools,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

# (output, content, [(name, arguments dict)])
HERMES = [
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ("  Hello <b>world</b> 1 < 2\n\n", "Hello <b>world</b> 1 < 2", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", None,
     [("get_weather", {"city": "Paris", "unit": "celsius"}),
      ("get_time", {"tz": "Europe/Paris"})]),
    (f"Let me check the weather.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n",
     "Let me check the weather.", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # the output ended before </tool_call>
    (f"<tool_call>\n{WEATHER}\n", None,
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}", None,
     [("get_weather", {"city": "Paris", "unit": "celsius"}),
      ("get_time", {"tz": "Europe/Paris"})]),
    # malformed JSON: the text is content
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', []),
    ('Sure.\n<tool_call>\n{"arguments": {}}\n</tool_call>',
     'Sure.\n<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    # a malformed block after a call: it and what follows are content
    (f"Sure.<tool_call>{WEATHER}</tool_call>\n<tool_call>{{bad}}</tool_call> Oops.",
     "Sure.<tool_call>{bad}</tool_call> Oops.",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    # non-ASCII arguments, arguments sent as a string, a near-miss marker
    ('<tool_call>\n{"name": "f", "arguments": {"q": "café ✓"}}\n</tool_call>', None,
     [("f", {"q": "café ✓"})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
    ("Use <tool_calls> or <tool_", "Use <tool_calls> or <tool_", []),
]

LLAMA = [
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("\n  I can't {do} that. ", "I can't {do} that.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
     None, [("a", {}), ("b", {"x": 1})]),
    (' {"name": "get_weather", "arguments": {"city": "Paris; France"}}\n', None,
     [("get_weather", {"city": "Paris; France"})]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}',
     '{"name": "get_weather", "parameters": {"city": "Paris"}', []),
    ('{"name": "a", "parameters": {}} and then', '{"name": "a", "parameters": {}} and then', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("<|python_", "<|python_", []),
    ('{"name": "a", "parameters": {}};', None, [("a", {})]),
    ('{"name": "a", "parameters": {}};;', '{"name": "a", "parameters": {}};;', []),
]

CASES = [("hermes", *c) for c in HERMES] + [("llama3_json", *c) for c in LLAMA]


def calls_of(msg: ParsedMessage) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_parse(parser, text, content, calls):
    msg = get_tool_parser(parser).parse(text)
    assert msg.content == content
    assert calls_of(msg) == calls
    for c in msg.tool_calls:
        assert c.id.startswith("call_") and len(c.id) > 10
        assert c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False)


def stream(parser_name: str, text: str, size: int):
    """Feed `text` in pieces of `size`; accumulate the deltas as the OpenAI client does."""
    parser = get_tool_parser(parser_name)
    deltas = []
    for i in range(0, len(text), size):
        deltas += parser.feed(text[i:i + size])
    deltas += parser.finish()
    content, calls = "", {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}) and d
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"name": None, "arguments": "", "id": None})
            if tc.get("id"):
                slot["id"] = slot["id"] or tc["id"]
            fn = tc.get("function", {})
            slot["name"] = slot["name"] or fn.get("name")
            slot["arguments"] += fn.get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return parser, content or None, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 3, 7, 10_000])
@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_stream_matches_parse(parser, text, content, calls, size):
    got_parser, got_content, got_calls = stream(parser, text, size)
    want = get_tool_parser(parser).parse(text)
    assert got_content == want.content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls_of(want)
    assert all(c["id"].startswith("call_") for c in got_calls)
    assert got_parser.called is bool(calls)


def test_marker_text_is_held_back():
    p = get_tool_parser("hermes")
    assert p.feed("Checking.") == [{"content": "Checking."}]
    assert p.feed(" <tool") == []  # could be the start of <tool_call>
    assert p.feed("s> are") == [{"content": " <tools> are"}]
    assert not p.called
    assert p.feed(f"<tool_call>{WEATHER}") == []
    out = p.feed("</tool_call>")
    assert p.called
    [tc] = out[0]["tool_calls"]
    assert tc["index"] == 0 and tc["type"] == "function"
    assert tc["function"]["name"] == "get_weather"
    assert p.feed(f"\n<tool_call>{TIME}</tool_call>")[0]["tool_calls"][0]["index"] == 1
    assert p.finish() == []


def test_llama_streams_plain_content_and_buffers_json():
    p = get_tool_parser("llama3_json")
    assert p.feed("  ") == []
    assert p.feed("Hi there") == [{"content": "Hi there"}]
    assert p.feed(" you") == [{"content": " you"}]
    p = get_tool_parser("llama3_json")
    assert p.feed("<|python") == [] and p.feed('_tag|>{"name": "a", "parameters": {}}') == []
    assert not p.called
    [d] = p.finish()
    assert d["tool_calls"][0]["function"] == {"name": "a", "arguments": "{}"}
    assert p.called


def test_parse_leaves_stream_state_alone():
    p = get_tool_parser("hermes")
    p.feed("Hello")
    assert p.parse(f"<tool_call>{WEATHER}</tool_call>").tool_calls
    assert not p.called
    assert p.finish() == []


def test_tool_call_to_openai():
    c = ToolCall("call_1", "f", '{"a": 1}')
    assert c.to_openai() == {"id": "call_1", "type": "function",
                             "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_unknown_parser():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError) as e:
        get_tool_parser("x")
    assert str(e.value) == "tool_call_parser: unknown parser 'x' (choose hermes, llama3_json)"


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "f"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]


@pytest.mark.parametrize("output", [
    [{"name": "get_weather", "parameters": {"city": "Paris"}}],
    [{"name": "get_time", "parameters": {}},
     {"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}],
])
def test_required_schema_accepts(output):
    schema = required_tools_schema(TOOLS)
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(output, schema)
    calls = parse_required(json.dumps(output))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(o["name"], o["parameters"]) for o in output]


@pytest.mark.parametrize("output", [
    [],
    {"name": "get_time", "parameters": {}},
    [{"name": "get_date", "parameters": {}}],
    [{"name": "get_weather", "parameters": {}}],
    [{"name": "get_weather", "parameters": {"city": 3}}],
    [{"name": "get_time"}],
    [{"parameters": {}}],
])
def test_required_schema_rejects(output):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(output, required_tools_schema(TOOLS))


def test_required_schema_default_parameters():
    schema = required_tools_schema(TOOLS)
    assert schema["minItems"] == 1
    time_item = schema["items"]["anyOf"][1]
    assert time_item["properties"]["name"] == {"type": "string", "enum": ["get_time"]}
    assert time_item["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert time_item["required"] == ["name", "parameters"]


@pytest.mark.parametrize("text", ["", "[", "{}", "[]", '[{"name": 1, "parameters": {}}]',
                                  '[{"name": "f", "parameters": [1]}]'])
def test_parse_required_rejects(text):
    with pytest.raises(ValueError):
        parse_required(text)


def test_named_tool_call():
    c = named_tool_call("get_weather", ' {"city":"Zürich"} ')
    assert (c.name, c.arguments) == ("get_weather", '{"city": "Zürich"}')
    assert c.id.startswith("call_")
    assert named_tool_call("f", '{"city": "Zür').arguments == '{"city": "Zür'
    assert named_tool_call("f", "{}").id != named_tool_call("f", "{}").id


@pytest.mark.parametrize("tools, choice", [
    (None, None), (None, "none"), ([], "none"), (TOOLS, None), (TOOLS, "none"),
    (TOOLS, "auto"), (TOOLS, "required"),
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}),
])
def test_validate_tools_ok(tools, choice):
    validate_tools(tools, choice)


@pytest.mark.parametrize("tools, choice, message", [
    ({"type": "function"}, None, "tools: "),
    (["get_weather"], None, "tools: "),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools: "),
    ([{"type": "function"}], None, "tools: "),
    ([{"type": "function", "function": {"description": "x"}}], None, "tools: "),
    ([{"type": "function", "function": {"name": 3}}], None, "tools: "),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools: "),
    (TOOLS + TOOLS[:1], None, "tools: "),
    (TOOLS, "any", "tool_choice: "),
    (TOOLS, {"type": "function", "name": "get_time"}, "tool_choice: "),
    (TOOLS, {"type": "function", "function": {"name": "x"}},
     "tool_choice: function 'x' is not among the tools"),
    (None, "auto", "tool_choice: "),
    ([], "required", "tool_choice: "),
    (None, {"type": "function", "function": {"name": "f"}}, "tool_choice: "),
])
def test_validate_tools_errors(tools, choice, message):
    with pytest.raises(ValueError) as e:
        validate_tools(tools, choice)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("text", ['{"name": "f", "parameters": ' + "[" * 5000,
                                  "<|python_tag|>" + "[" * 3000 + "]" * 3000],
                         ids=["unterminated", "balanced"])
def test_output_nested_past_the_stack_is_content_not_a_crash(text):
    """A model's output nested deeper than Python's stack is malformed tool-call JSON: it
    comes back as content, streamed or not."""
    assert get_tool_parser("llama3_json").parse(text).content == text
    _, content, calls = stream("llama3_json", text, 1000)
    assert content == text and calls == []
