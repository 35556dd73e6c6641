"""Structured outputs and tool calling over HTTP, with the official `openai` client, against a
real `pdserve serve` process running the bundled SmolLM2 and the xgrammar engine. Outputs are
checked with jsonschema / re.fullmatch, never by comparing with expected text."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from cluster_procs import GatewayProcess

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
# A Hermes-style tool-use template (SmolLM2's own template knows no tools).
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You can call these functions: {{ tools | tojson }}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}{% elif m.role == "tool" %}<tool_response>
{{ m.content }}
</tool_response>{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    gw = GatewayProcess("SmolLM2-135M-Instruct", "--kv-cache-memory-bytes", str(96 << 20),
                        "--chat-template", str(template), "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes")
    yield gw
    gw.stop()
    assert gw.proc.returncode == 0, "".join(gw.log[-30:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_response_format_json_schema(client):
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=80, temperature=0.8, seed=1, n=2,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_object_on_completions(client):
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="A JSON object:",
                                    max_tokens=60, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop", out.choices[0].text
    assert isinstance(json.loads(out.choices[0].text), dict)


def test_structured_outputs_extra_body_regex_choice_grammar(client):
    pattern = r"[A-Z][a-z]{2,6}-\d{2}"
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="A code:",
                                    max_tokens=20, temperature=1.0, seed=3, n=3,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    for c in out.choices:
        assert re.fullmatch(pattern, c.text), c.text
    choices = ["yes", "no", "it depends"]
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        extra_body={"structured_outputs": {"choice": choices}})
    assert out.choices[0].message.content in choices
    out = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Count:", max_tokens=20, temperature=0,
        extra_body={"guided_grammar": 'root ::= "one" (", " ("two" | "three")){1,3} "."'})
    assert re.fullmatch(r"one(, (two|three)){1,3}\.", out.choices[0].text), out.choices[0].text


def test_streamed_schema_output_validates(client):
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=80, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
])
def test_bad_constraints_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tool_choice_required_and_named(client):
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK,
                                         tools=[WEATHER, TIME], tool_choice="required",
                                         max_tokens=120, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK,
                                         tools=[WEATHER, TIME], tool_choice=named,
                                         max_tokens=60, temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), params["get_weather"])


def _stream_calls(stream) -> tuple[str, dict[int, dict], str | None]:
    """Content, tool calls accumulated by index (as the openai client's helpers do), and the
    finish reason of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or tc.id
            if tc.function.name:
                call["name"] = tc.function.name
            call["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_calls(client, tool_choice):
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK,
                                            tools=[WEATHER, TIME], tool_choice=tool_choice,
                                            max_tokens=120, temperature=0, stream=True)
    _, calls, finish = _stream_calls(stream)
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"] and call["name"] in ("get_weather", "get_time")
        json.loads(call["arguments"])


def test_auto_tool_choice_parses_the_models_tool_call(client):
    """tool_choice auto: the model's free text is read by the hermes parser. The model is made
    to write a call (a regex constraint), so the parse is exercised end to end."""
    forced = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
              r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>')
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER],
                  max_tokens=80, temperature=0, extra_body={"structured_outputs": {
                      "regex": forced}})
    out = client.chat.completions.create(**kwargs)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me check."
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] == "celsius"
    content, calls, finish = _stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_tool_messages_round_trip_through_the_template(http):
    """An assistant's tool_calls (arguments as JSON text) and the tool's answer reach the
    template: arguments as an object, the answer in <tool_response>."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER],
                                                "tool_choice": "none", "max_tokens": 3,
                                                "return_token_ids": True})
    assert r.status_code == 200, r.text
    prompt = http.post("/detokenize", json={"tokens": r.json()["prompt_token_ids"]}).json()
    text = prompt["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    assert '"get_weather"' in text.split("<|im_start|>user")[0]  # the tools, in the system turn


def test_auto_needs_the_server_flags(tmp_path):
    """Without --enable-auto-tool-choice, tools with tool_choice auto are refused (as vLLM)."""
    from pdserve.gateway.protocol import ChatCompletionRequest
    from pdserve.gateway.serving import ServingContext

    req = ChatCompletionRequest(messages=ASK, tools=[WEATHER])
    ctx = ServingContext(None, None, "m", 100, None)
    from pdserve.gateway.chat import ChatRun
    from pdserve.gateway.protocol import APIError

    with pytest.raises(APIError) as e:
        ChatRun(ctx, req)
    assert e.value.param == "tool_choice"


def test_responses_api_text_json_and_stream(client, http):
    out = client.responses.create(model="SmolLM2-135M-Instruct", input="Say hello.",
                                  instructions="Be brief.", max_output_tokens=12,
                                  temperature=0)
    assert out.status in ("completed", "incomplete") and out.output_text
    assert out.usage.output_tokens > 0 and out.usage.input_tokens > 0
    shaped = client.responses.create(
        model="SmolLM2-135M-Instruct", max_output_tokens=200, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text",
                                             "text": "Invent a person."}]}],
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    assert shaped.status == "completed"
    jsonschema.validate(json.loads(shaped.output_text), PERSON)
    events = list(client.responses.create(model="SmolLM2-135M-Instruct", input="Say hello.",
                                          instructions="Be brief.", max_output_tokens=12,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == out.output_text == events[-1].response.output_text
    r = http.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
