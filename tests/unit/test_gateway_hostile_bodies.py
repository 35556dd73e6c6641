"""Bodies that once reached a 500 or grew the gateway: lone surrogates, huge beam length
penalties, non-text parts in /v1/responses, floods of unknown field names; and errors in the
middle of a /v1/responses stream arrive as the Responses API's own `error` event."""

from __future__ import annotations

import json
import logging

import pytest
from test_gateway_app import error
from test_gateway_vllm_http import backend, client  # noqa: F401 (fixtures)

from pdserve.gateway.app import MAX_WARNED_FIELDS


def post_raw(client, path, text):
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"prompt": "a\\ud800", "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("/v1/responses", '{"input": "hi", "metadata": {"k": "\\ud800"}, "stream": true}'),
    ("/tokenize", '{"prompt": "\\ud83d"}'),
])
def test_a_lone_surrogate_is_a_400_not_a_500(client, backend, path, body):
    assert "surrogate" in error(post_raw(client, path, body), 400)["message"]
    assert backend.started == []
    ok = post_raw(client, "/v1/completions", '{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert ok.status_code == 200, ok.text  # a surrogate pair is one character: fine


@pytest.mark.parametrize("penalty", [400, -400, float("inf")])
def test_a_beam_length_penalty_out_of_range_is_a_400(client, penalty):
    body = {"prompt": "hello", "max_tokens": 4, "n": 2, "use_beam_search": True,
            "length_penalty": penalty}
    r = post_raw(client, "/v1/completions", json.dumps(body))
    assert error(r, 400)["param"] == "length_penalty"


@pytest.mark.parametrize("text", [5, None, ["a"]])
def test_a_responses_text_part_that_is_not_a_string_is_a_400(client, text):
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]}
    assert error(client.post("/v1/responses", json=body), 400)["param"] == "input"


def test_unknown_field_names_are_remembered_and_logged_boundedly(client, caplog):
    caplog.set_level(logging.WARNING)
    for batch in range(3):
        body = {"prompt": "x", "max_tokens": 1,
                **{f"junk_{batch}_{i}": 1 for i in range(MAX_WARNED_FIELDS)}}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert len(client.app.state.warned_fields) == MAX_WARNED_FIELDS
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1 and "no further names" in lines[0] and len(lines[0]) < 2000


def test_a_failure_mid_stream_on_responses_is_an_error_event(client, backend):
    backend.fail_mid = True
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3,
                                           "stream": True})
    events = [block for block in r.text.split("\n\n") if block]
    last = events[-1].splitlines()
    assert last[0] == "event: error"
    data = json.loads(last[1].removeprefix("data: "))
    assert data["type"] == "error" and "decode instance died" in data["message"]
    assert isinstance(data["sequence_number"], int) and data["code"]


@pytest.mark.parametrize("path, body, param, starts", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages",
     "messages.0.content: only text parts are supported, got a part of type 'image_url'"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 0}, "n", ""),
    ("/v1/responses", {"input": []}, "input", "input: "),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "xml"}}}, "text",
     "text.format.type: "),
    ("/v1/responses", {"input": "x", "max_output_tokens": 10 ** 9}, "max_output_tokens",
     "max_output_tokens"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-300}, "repetition_penalty",
     "repetition_penalty must be a positive float32 number"),  # 0 in the float32 logits
])
def test_a_400_names_the_field_the_request_sent(client, path, body, param, starts):
    """Each names its own field: a Responses request is served as a chat request, whose
    field names (messages, max_tokens, response_format) it does not have."""
    err = error(client.post(path, json=body), 400)
    assert err["param"] == param and err["message"].startswith(starts), err
    assert "validation error for" not in err["message"]  # no raw pydantic dump
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text  # and the gateway still serves
