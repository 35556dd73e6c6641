"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated
like a completion; answered as a chat.completion or as chat.completion.chunk SSE events."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

from pdserve.gateway.backend import BackendError
from pdserve.gateway.beam_stream import beam_generation
from pdserve.gateway.chat_tools import ToolCallOutput
from pdserve.gateway.generation import Generation
from pdserve.gateway.protocol import ChatCompletionRequest, bad_request
from pdserve.gateway.serving import (
    Choice,
    ServingContext,
    chat_logprobs,
    chunk_usage,
    error_event,
    prompt_logprobs_json,
    sse,
)

logger = logging.getLogger(__name__)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A complete output that made tool calls ends with "tool_calls", as OpenAI's."""
    return "tool_calls" if reason == "stop" and called else reason


class ChatRun:
    """One request: checked and tokenized on construction; `start`, then `respond` or
    `stream` (the caller closes the Generation)."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest):
        self.ctx, self.req = ctx, req
        # vLLM's: the server's --response-role, or the last message's role when the request
        # continues it (add_generation_prompt false)
        self.role = ctx.response_role if req.add_generation_prompt else req.messages[-1].role
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tool_choice = req.effective_tool_choice
        if self.tool_choice == "auto" and ctx.tool_parser is None:
            raise bad_request('tool_choice: "auto" needs the server started with '
                              '--enable-auto-tool-choice and --tool-call-parser', "tool_choice")
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            template_kwargs["tools"] = req.tools
        self.prompt_ids = req.truncate(
            ctx.encode_chat([m.for_template() for m in req.messages], req.add_generation_prompt,
                            req.continue_final_message, template_kwargs),
            ctx.max_model_len)
        max_tokens = ctx.max_tokens(len(self.prompt_ids), req.requested_max_tokens, "messages")
        if req.use_beam_search:
            self.params = req.beam_search_params(
                max_tokens, (req.top_logprobs or 0) if req.logprobs else None, ctx.max_logprobs)
        else:
            self.params = req.sampling_params(max_tokens, ctx.max_logprobs,
                                              ctx.sampling_defaults)
        self.k = req.top_logprobs or 0
        if req.prompt_logprobs is not None and not ctx.backend.supports_prompt_logprobs:
            raise bad_request("prompt_logprobs: not available from this backend",
                              "prompt_logprobs")
        self.counts: dict[int, int] = {}  # streamed: choice index -> tokens so far
        self.backend_requests = req.n if req.use_beam_search else 1  # admission counts these

    async def start(self) -> Generation:
        if self.req.use_beam_search:
            return beam_generation(self.ctx, self.id, [(self.prompt_ids, self.params)],
                                   self.req.priority, self.req.cache_salt)
        return await Generation.start(self.ctx.backend, self.id, [(self.prompt_ids, self.params)],
                                      self.ctx.metrics, self.req.priority, self.req.cache_salt)

    def _tools(self) -> ToolCallOutput | None:
        """A choice's tool-call reader; None when the request uses no tools."""
        if self.tool_choice == "none":
            return None
        return ToolCallOutput(self.tool_choice, self.ctx.tool_parser)

    def _logprobs(self, positions, token_ids) -> dict | None:
        if not self.req.logprobs or positions is None:
            return None
        return chat_logprobs(self.ctx, positions, token_ids, self.k,
                             self.ctx.tokens_as_ids(self.req))

    async def respond(self, gen: Generation) -> dict:
        choices: dict[int, Choice] = {}
        prompt_logprobs = None
        async for idx, delta in gen:
            if delta.prompt_logprobs is not None:
                prompt_logprobs = delta.prompt_logprobs
            choices.setdefault(idx, Choice()).add(delta)
        out = []
        for idx in range(self.req.n):
            c = choices.get(idx, Choice())
            tools = self._tools()
            message = tools.message(c.text) if tools else {"content": c.text}
            message = {"role": self.role, **{k: v for k, v in message.items() if k != "role"}}
            called = bool(message.get("tool_calls"))
            choice = {"index": idx, "message": message,
                      "logprobs": self._logprobs(c.logprobs, c.token_ids),
                      "finish_reason": _finish_reason(c.finish_reason, called),
                      "stop_reason": c.stop_reason}
            if self.req.return_token_ids:
                choice["token_ids"] = c.token_ids
            out.append(choice)
        body = {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.ctx.model_name, "choices": out, "usage": gen.usage.to_dict()}
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        if self.req.prompt_logprobs is not None:  # vLLM: on the response (completions: per choice)
            positions = prompt_logprobs or [None] * len(self.prompt_ids)
            body["prompt_logprobs"] = prompt_logprobs_json(positions, self.req.prompt_logprobs)
        return body

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.ctx.model_name, "choices": choices}
        if self.req.continuous_usage and len(choices) == 1:
            # vLLM's continuous_usage_stats: the choice's tokens so far on every chunk.
            chunk["usage"] = chunk_usage(len(self.prompt_ids),
                                         self.counts.get(choices[0]["index"], 0))
        elif self.req.include_usage:
            chunk["usage"] = None
        return chunk

    async def stream(self, gen: Generation) -> AsyncIterator[str]:
        try:
            ids = self.req.return_token_ids
            for idx in range(self.req.n):
                chunk = self._chunk([{"index": idx,
                                      "delta": {"role": self.role, "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                if ids and idx == 0:
                    chunk["prompt_token_ids"] = self.prompt_ids
                yield sse(chunk)
            tools = {idx: self._tools() for idx in range(self.req.n)}
            async for idx, d in gen:
                self.counts[idx] = self.counts.get(idx, 0) + len(d.token_ids)
                logprobs = self._logprobs(d.logprobs, d.token_ids)
                reader = tools.get(idx)
                if reader is None:
                    deltas = [{"content": d.text}] if d.text else []
                else:
                    deltas = reader.feed(d.text) + (reader.finish() if d.finish_reason else [])
                if not (deltas or d.finish_reason or (logprobs and logprobs["content"])
                        or (ids and d.token_ids)):
                    continue
                for delta in deltas[:-1]:  # all but the last: no logprobs or finish yet
                    yield sse(self._chunk([{"index": idx, "delta": delta, "logprobs": None,
                                            "finish_reason": None}]))
                choice = {"index": idx, "delta": deltas[-1] if deltas else {},
                          "logprobs": logprobs,
                          "finish_reason": _finish_reason(d.finish_reason,
                                                          reader is not None and reader.called),
                          "stop_reason": d.stop_reason}
                if ids:
                    choice["token_ids"] = list(d.token_ids)
                yield sse(self._chunk([choice]))
            if self.req.include_usage:
                yield sse(self._chunk([]) | {"usage": gen.usage.to_dict()})
        except (BackendError, ValueError) as e:
            yield error_event(e)
        except Exception as e:  # a bug: still end the stream with an error event
            logger.exception("stream %s failed", self.id)
            yield error_event(e)
        yield sse("[DONE]")
