"""POST /v1/responses for text: OpenAI's Responses API over the chat path. The input (a string,
or message items) and `instructions` become a conversation rendered with the chat template;
`text.format` becomes a structured-outputs constraint; the answer is one output message, whole
or as the Responses stream events (response.created ... response.completed).

Not kept: responses are not stored, so `previous_response_id` and `store` retrieval are refused
(400); tools, reasoning and non-text inputs are refused too.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import Field, ValidationError

from pdserve.gateway.backend import BackendError
from pdserve.gateway.chat import ChatRun
from pdserve.gateway.generation import Generation
from pdserve.gateway.protocol import APIError, ChatCompletionRequest, _Body, bad_request
from pdserve.gateway.serving import ServingContext, api_error_of

logger = logging.getLogger(__name__)
_ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    tools: list[dict] | None = None
    reasoning: dict | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    seed: int | None = None  # vLLM's extra

    def chat_request(self) -> ChatCompletionRequest:
        """The same generation as a chat completion request; 400 naming what is refused."""
        if self.previous_response_id is not None:
            raise bad_request("previous_response_id: responses are not stored here",
                              "previous_response_id")
        if self.tools:
            raise bad_request("tools: not supported on /v1/responses (use chat completions)",
                              "tools")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions \
            else []
        messages += _messages(self.input)
        fmt = (self.text or {}).get("format")
        response_format = None
        if fmt is not None:
            if not isinstance(fmt, dict) or "type" not in fmt:
                raise bad_request("text.format: expected an object with a type", "text")
            response_format = {"type": fmt["type"]}
            if fmt["type"] == "json_schema":
                response_format["json_schema"] = {k: fmt.get(k) for k in ("name", "schema",
                                                                          "strict")}
        try:
            return ChatCompletionRequest(
                messages=messages, max_tokens=self.max_output_tokens,
                temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                stream=self.stream, response_format=response_format)
        except ValidationError as e:
            err = e.errors()[0]
            loc = [str(x) for x in err["loc"]]
            msg = err["msg"].removeprefix("Value error, ")
            raise in_responses_terms(bad_request(f"{'.'.join(loc)}: {msg}",
                                                 loc[0] if loc else None)) from e


# The chat request's fields that a Responses request sets under other names.
_RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
                    "response_format": "text.format"}


def in_responses_terms(e: APIError) -> APIError:
    """A chat request's error as the Responses request that made it would name the field."""
    name = _RESPONSES_NAMES.get(e.param or "")
    if name is None:
        return e
    message = e.message
    if message.startswith(e.param):
        message = name + message[len(e.param):]
    return APIError(e.status, message, e.type, name.split(".")[0], e.code)


def _messages(items: str | list[dict]) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        role = item.get("role")
        if kind != "message" or role not in _ROLES:
            raise bad_request(f"input[{i}]: only message items with role "
                              f"{', '.join(_ROLES)} are supported", "input")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("input_text",
                                                                          "output_text"):
                    raise bad_request(f"input[{i}].content: only text parts are supported",
                                      "input")
                if not isinstance(part.get("text", ""), str):
                    raise bad_request(f"input[{i}].content: a text part's text must be a "
                                      f"string", "input")
                parts.append(part.get("text", ""))
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad_request(f"input[{i}].content: expected text", "input")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


class ResponsesRun:
    """One /v1/responses request, with the interface of the chat and completion runs."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest):
        self.req = req
        try:
            self.chat = ChatRun(ctx, req.chat_request())
        except APIError as e:
            raise in_responses_terms(e) from e
        self.backend_requests = self.chat.backend_requests
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = ctx.model_name

    async def start(self) -> Generation:
        return await self.chat.start()

    def _response(self, status: str, text: str | None, gen: Generation | None,
                  finish_reason: str | None = None) -> dict:
        output = []
        if text is not None:
            output.append({"type": "message", "id": self.message_id, "status": status,
                           "role": "assistant", "content": [
                               {"type": "output_text", "text": text, "annotations": []}]})
        usage = None
        if gen is not None and status != "in_progress":
            u = gen.usage
            usage = {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                     "total_tokens": u.prompt_tokens + u.completion_tokens,
                     "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {"id": self.id, "object": "response", "created_at": self.created,
                "model": self.model, "status": status, "output": output, "usage": usage,
                "incomplete_details": incomplete, "error": None,
                "instructions": self.req.instructions, "metadata": self.req.metadata or {},
                "max_output_tokens": self.req.max_output_tokens,
                "temperature": self.req.temperature, "top_p": self.req.top_p,
                "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
                "text": self.req.text or {"format": {"type": "text"}}}

    async def respond(self, gen: Generation) -> dict:
        text, finish = "", None
        async for _, delta in gen:
            text += delta.text
            finish = delta.finish_reason or finish
        status = "incomplete" if finish == "length" else "completed"
        return self._response(status, text, gen, finish)

    async def stream(self, gen: Generation) -> AsyncIterator[str]:
        seq = iter(range(1 << 30))

        def event(kind: str, **data) -> str:
            body = {"type": kind, "sequence_number": next(seq), **data}
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        try:
            yield event("response.created", response=self._response("in_progress", None, None))
            yield event("response.in_progress",
                        response=self._response("in_progress", None, None))
            item = self._response("in_progress", "", None)["output"][0]
            yield event("response.output_item.added", output_index=0, item=item)
            yield event("response.content_part.added", **where,
                        part={"type": "output_text", "text": "", "annotations": []})
            text, finish = "", None
            async for _, delta in gen:
                if delta.text:
                    text += delta.text
                    yield event("response.output_text.delta", **where, delta=delta.text)
                finish = delta.finish_reason or finish
            status = "incomplete" if finish == "length" else "completed"
            done = self._response(status, text, gen, finish)
            yield event("response.output_text.done", **where, text=text)
            yield event("response.content_part.done", **where,
                        part=done["output"][0]["content"][0])
            yield event("response.output_item.done", output_index=0, item=done["output"][0])
            yield event(f"response.{status}", response=done)
        except (BackendError, ValueError) as e:
            yield self._error_event(event, e)
        except Exception as e:  # a bug: still end the stream with an error event
            logger.exception("response %s failed", self.id)
            yield self._error_event(event, e)

    @staticmethod
    def _error_event(event: Callable[..., str], e: Exception) -> str:
        """The Responses API's `error` event (type, code, message, param)."""
        err = api_error_of(e)
        return event("error", code=err.code or err.type, message=err.message, param=err.param)

