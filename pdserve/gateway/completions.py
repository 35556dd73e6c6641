"""POST /v1/completions: prompts in, text completions out (whole, or as SSE chunks)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

from pdserve.gateway.backend import BackendError, PositionLogprobs
from pdserve.gateway.beam_stream import beam_generation
from pdserve.gateway.generation import Generation
from pdserve.gateway.protocol import CompletionRequest, bad_request
from pdserve.gateway.serving import (
    Choice,
    CompletionLogprobs,
    ServingContext,
    chunk_usage,
    error_event,
    prompt_logprobs_json,
    sse,
)

logger = logging.getLogger(__name__)


def _merge(a: dict | None, b: dict) -> dict:
    return b if a is None else {k: a[k] + b[k] for k in a}


class CompletionRun:
    """One request: checked and tokenized on construction; `start`, then `respond` or
    `stream` (the caller closes the Generation)."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest):
        self.ctx, self.req = ctx, req
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        prompts = req.prompts()
        encoded = [ctx.encode(p) if isinstance(p, str) else p for p in prompts]
        self.prompt_ids = [req.truncate(ids, ctx.max_model_len) for ids in encoded]
        # A truncated prompt is echoed as the text of the tokens kept.
        self.prompt_texts = [p if isinstance(p, str) and len(ids) == len(full) else None
                             for p, ids, full in zip(prompts, self.prompt_ids, encoded)]
        if req.use_beam_search:
            self.requests = [(ids, req.beam_search_params(
                ctx.max_tokens(len(ids), req.max_tokens), req.logprobs, ctx.max_logprobs))
                for ids in self.prompt_ids]
        else:
            self.requests = [(ids, req.sampling_params(ctx.max_tokens(len(ids), req.max_tokens),
                                                       ctx.max_logprobs, ctx.sampling_defaults))
                             for ids in self.prompt_ids]
        if not ctx.backend.supports_prompt_logprobs:
            if req.prompt_logprobs is not None:
                raise bad_request("prompt_logprobs: not available from this backend",
                                  "prompt_logprobs")
            if req.echo and req.logprobs is not None:
                raise bad_request("echo: prompt logprobs are not available from this backend",
                                  "echo")
        self.n = req.n
        self.prompt_logprobs: dict[int, list[PositionLogprobs]] = {}
        # one per prompt, or per beam: what the gateway's admission counts
        self.backend_requests = len(self.requests) * (req.n if req.use_beam_search else 1)

    def echo_text(self, p: int) -> str:
        text = self.prompt_texts[p]
        return text if text is not None else self.ctx.decode(self.prompt_ids[p])

    def echo_logprobs(self, p: int, fmt: CompletionLogprobs) -> dict:
        positions = self.prompt_logprobs.get(p) or [None] * len(self.prompt_ids[p])
        return fmt.format(positions, self.prompt_ids[p])

    def _note(self, idx: int, delta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[idx // self.n] = delta.prompt_logprobs

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices}

    async def start(self) -> Generation:
        if self.req.use_beam_search:
            return beam_generation(self.ctx, self.id, self.requests, self.req.priority,
                                   self.req.cache_salt)
        return await Generation.start(self.ctx.backend, self.id, self.requests, self.ctx.metrics,
                                      self.req.priority, self.req.cache_salt)

    async def respond(self, gen: Generation) -> dict:
        choices: dict[int, Choice] = {}
        async for idx, delta in gen:
            self._note(idx, delta)
            choices.setdefault(idx, Choice()).add(delta)
        out = []
        for idx in range(len(self.requests) * self.n):
            c, p = choices.get(idx, Choice()), idx // self.n
            text, logprobs = c.text, None
            if self.req.logprobs is not None:
                fmt = CompletionLogprobs(self.ctx, self.req.logprobs,
                                         as_ids=self.ctx.tokens_as_ids(self.req))
                if self.req.echo:
                    logprobs = self.echo_logprobs(p, fmt)
                logprobs = _merge(logprobs, fmt.format(c.logprobs, c.token_ids))
            if self.req.echo:
                text = self.echo_text(p) + text
            choice = {"index": idx, "text": text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if self.req.prompt_logprobs is not None:
                positions = self.prompt_logprobs.get(p) or [None] * len(self.prompt_ids[p])
                choice["prompt_logprobs"] = prompt_logprobs_json(positions,
                                                                 self.req.prompt_logprobs)
            if self.req.return_token_ids:
                choice["prompt_token_ids"] = self.prompt_ids[p]
                choice["token_ids"] = c.token_ids
            out.append(choice)
        body = self._chunk(out)
        body["usage"] = gen.usage.to_dict()
        return body

    def _usage_field(self, idx: int, counts: dict[int, int]) -> dict:
        """What a streamed chunk of choice `idx` says of usage: nothing, null, or (vLLM's
        continuous_usage_stats) its prompt's tokens and the choice's tokens so far."""
        if not self.req.include_usage:
            return {}
        if not self.req.continuous_usage:
            return {"usage": None}
        return {"usage": chunk_usage(len(self.prompt_ids[idx // self.n]), counts.get(idx, 0))}

    async def stream(self, gen: Generation) -> AsyncIterator[str]:
        fmts: dict[int, CompletionLogprobs] = {}
        counts: dict[int, int] = {}  # choice index -> tokens generated so far
        try:
            async for idx, d in gen:
                self._note(idx, d)
                counts[idx] = counts.get(idx, 0) + len(d.token_ids)
                text, logprobs = d.text, None
                first = idx not in fmts
                fmt = fmts.setdefault(idx, CompletionLogprobs(
                    self.ctx, self.req.logprobs or 0, as_ids=self.ctx.tokens_as_ids(self.req)))
                if self.req.echo and first:
                    text = self.echo_text(idx // self.n) + text
                    if self.req.logprobs is not None:
                        logprobs = self.echo_logprobs(idx // self.n, fmt)
                if self.req.logprobs is not None and d.logprobs is not None:
                    logprobs = _merge(logprobs, fmt.format(d.logprobs, d.token_ids))
                ids = self.req.return_token_ids
                if not (text or d.finish_reason or (logprobs and logprobs["tokens"])
                        or (ids and (first or d.token_ids))):
                    continue
                choice = {"index": idx, "text": text, "logprobs": logprobs,
                          "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
                if ids:
                    if first:
                        choice["prompt_token_ids"] = self.prompt_ids[idx // self.n]
                    choice["token_ids"] = list(d.token_ids)
                yield sse(self._chunk([choice]) | self._usage_field(idx, counts))
            if self.req.include_usage:
                yield sse(self._chunk([]) | {"usage": gen.usage.to_dict()})
        except (BackendError, ValueError) as e:
            yield error_event(e)
        except Exception as e:  # a bug: still end the stream with an error event
            logger.exception("stream %s failed", self.id)
            yield error_event(e)
        yield sse("[DONE]")
