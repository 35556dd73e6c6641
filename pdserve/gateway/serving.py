"""What the completion and chat handlers share: prompt tokenization, the context budget, SSE
framing, per-choice accumulation, and OpenAI's two logprobs formats."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.backend import Backend, Delta, PositionLogprobs, TokenLogprob
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.protocol import APIError, bad_request

MIN_LOGPROB = -9999.0  # -inf is not JSON


@dataclass
class ServingContext:
    backend: Backend
    tokenizer: Any
    model_name: str
    max_model_len: int
    metrics: GatewayMetrics
    max_logprobs: int = 20  # the most logprobs a request may ask for (-1: no cap)
    tool_parser: str | None = None  # tool_choice "auto" reads calls with it (None: refused)
    # The model's recommended sampling settings, for requests that leave them unset.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # The most max_tokens a request gets, even one that asks for more (None: no cap).
    max_tokens_cap: int | None = None
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:<id>" by default
    response_role: str = "assistant"  # the role of chat completions' messages

    def tokens_as_ids(self, req) -> bool:
        """Whether `req`'s logprobs name tokens by id (its own field, else the server's)."""
        asked = getattr(req, "return_tokens_as_token_ids", None)
        return self.return_tokens_as_token_ids if asked is None else asked

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, as the engine's input processor makes them."""
        if add_special_tokens:
            return list(self.tokenizer.encode(text))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    kwargs: dict | None = None, add_special_tokens: bool = False) -> list[int]:
        """The conversation rendered with the model's chat template, as `LLM.chat` does."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(kwargs or {}))
        except Exception as e:  # jinja raises many kinds
            raise bad_request(f"messages: the chat template failed: {e}", "messages") from e
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def max_tokens(self, prompt_len: int, requested: int | None, what: str = "prompt") -> int:
        """`requested`, checked against the room left in the context; if None, the room, or
        the model's recommended max_tokens when that is less; either at most
        `max_tokens_cap` (as vLLM's server)."""
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise bad_request(
                f"{what}: {prompt_len} tokens leave no room to generate within this model's "
                f"maximum context length of {self.max_model_len} tokens", what)
        if requested is None:
            return min(room, self.sampling_defaults.get("max_tokens", room))
        if isinstance(requested, int) and requested > room:
            raise bad_request(
                f"max_tokens: this model's maximum context length is {self.max_model_len} "
                f"tokens; you requested {prompt_len + requested} tokens ({prompt_len} in the "
                f"{what}, {requested} in the completion)", "max_tokens")
        if isinstance(requested, int) and self.max_tokens_cap is not None:
            return min(requested, self.max_tokens_cap)
        return requested


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                                   separators=(",", ":"))
    return f"data: {data}\n\n"


def chunk_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """vLLM's per-chunk usage (stream_options.continuous_usage_stats): the prompt's tokens and
    the choice's tokens generated so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def gather_or_cancel(*aws: Awaitable[Any]) -> list[Any]:
    """asyncio.gather that cancels the others when one fails (or the caller is cancelled),
    so no backend request outlives the HTTP request that made it."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def api_error_of(e: Exception) -> APIError:
    """A failure after a stream started, as the APIError it would have been before."""
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(getattr(e, "status", 500), str(e), getattr(e, "type", "internal_error"),
                    code=getattr(e, "code", "internal_error"))


def error_event(e: Exception) -> str:
    """An SSE event in OpenAI's error shape, for a failure after the stream started."""
    return sse(api_error_of(e).body())


@dataclass
class Choice:
    """A completion accumulated from its deltas (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs.extend(d.logprobs)
        if d.finish_reason:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _ranked(pos: list[TokenLogprob], k: int) -> list[TokenLogprob]:
    """The top-k entries of a position by rank (the sampled one only if it ranks)."""
    ranked = sorted((e for e in pos if e.rank is not None), key=lambda e: e.rank)
    return ranked[:k]


class CompletionLogprobs:
    """Legacy completions format: tokens, token_logprobs, top_logprobs, text_offset.
    `top_logprobs` holds the k most likely tokens plus the sampled one, as OpenAI's did."""

    def __init__(self, ctx: ServingContext, k: int, offset: int = 0, as_ids: bool = False):
        self.ctx, self.k, self.offset, self.as_ids = ctx, k, offset, as_ids

    def format(self, positions: list[PositionLogprobs], token_ids: list[int]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for pos, tid in zip(positions, token_ids):
            if pos:
                text = _token(pos[0], self.as_ids)
                top = {_token(e, self.as_ids): _lp(e.logprob) for e in _ranked(pos, self.k)}
                top.setdefault(text, _lp(pos[0].logprob))
                out["token_logprobs"].append(_lp(pos[0].logprob))
                out["top_logprobs"].append(top)
            else:
                text = f"token_id:{tid}" if self.as_ids else self.ctx.decode([tid])
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def prompt_logprobs_json(positions: list[PositionLogprobs], k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token_id (str):
    {logprob, rank, decoded_token}} for the prompt token and the k most likely ones."""
    out: list[dict | None] = []
    for pos in positions:
        if not pos:
            out.append(None)
            continue
        kept = [pos[0]] + [e for e in pos[1:] if e.rank is not None and e.rank <= k]
        out.append({str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank,
                                      "decoded_token": e.text} for e in kept})
    return out


def _token(entry: TokenLogprob, as_ids: bool) -> str:
    """A logprob entry's token: its text, or "token_id:<id>" (vLLM's, for tokens whose text
    is not valid UTF-8 on its own)."""
    return f"token_id:{entry.token_id}" if as_ids else entry.text


def chat_logprobs(ctx: ServingContext, positions: list[PositionLogprobs],
                  token_ids: list[int], k: int, as_ids: bool = False) -> dict:
    """Chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def entry(text: str, logprob: float | None) -> dict:
        return {"token": text, "logprob": MIN_LOGPROB if logprob is None else _lp(logprob),
                "bytes": list(text.encode("utf-8"))}

    content = []
    for pos, tid in zip(positions, token_ids):
        if pos:
            item = entry(_token(pos[0], as_ids), pos[0].logprob)
            item["top_logprobs"] = [entry(_token(e, as_ids), e.logprob)
                                    for e in _ranked(pos, k)]
        else:
            item = entry(f"token_id:{tid}" if as_ids else ctx.decode([tid]), None)
            item["top_logprobs"] = []
        content.append(item)
    return {"content": content}
