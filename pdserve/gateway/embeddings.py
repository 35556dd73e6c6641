"""OpenAI's POST /v1/embeddings: one embedding per input (a text, or token ids), computed by
the backend as a pooling request (the last token's final hidden state, see
engine/pooling.py), by a local engine or, through the router (`Router.Embed`), by one
instance of the cluster."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Literal

import numpy as np

from pdserve.gateway.protocol import APIError, _Body, bad_request
from pdserve.gateway.serving import ServingContext, gather_or_cancel
from pdserve.pooling_params import PoolingParams


class EmbeddingRequest(_Body):
    """`input`: a text, a list of texts, a list of token ids, or a list of such lists."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extra fields
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None


_FIELDS = ("input", "dimensions", "encoding_format", "model", "prompt", "normalize",
           "truncate_prompt_tokens")


def _inputs(ctx: ServingContext, value) -> list[list[int]]:
    """Every input as token ids (texts are tokenized with the engine's tokenizer)."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise bad_request("input: must not be empty", "input")
    if all(isinstance(v, int) for v in value):  # one tokenized input
        value = [value]
    prompts = []
    for i, v in enumerate(value):
        ids = ctx.encode(v) if isinstance(v, str) else list(v)
        if not ids:
            raise bad_request(f"input[{i}]: must not be empty", "input")
        prompts.append(ids)
    return prompts


def _encode(embedding: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


class EmbeddingRun:
    """One request: checked and tokenized on construction (`prompts`: one backend request
    each); `respond` embeds them all."""

    def __init__(self, ctx: ServingContext, req: EmbeddingRequest):
        self.ctx, self.req = ctx, req
        try:
            self.pooling = PoolingParams(req.normalize, req.dimensions,
                                         req.truncate_prompt_tokens)
            # truncated here, so usage counts the tokens embedded
            self.prompts = [self.pooling.truncate_prompt(ids, ctx.max_model_len)
                            for ids in _inputs(ctx, req.input)]
        except ValueError as e:
            field = str(e).replace(":", " ").split(" ", 1)[0]
            raise bad_request(str(e), field if field in _FIELDS else None) from e

    async def respond(self) -> dict:
        base = f"embd-{uuid.uuid4().hex}"
        try:
            embeddings = await gather_or_cancel(*(
                self.ctx.backend.embed(f"{base}-{i}", ids, self.pooling)
                for i, ids in enumerate(self.prompts)))
        except ValueError as e:
            head = str(e).replace(":", " ").split(" ", 1)[0]
            field = "input" if head.startswith("prompt") else head
            raise APIError(400, str(e), param=field if field in _FIELDS else None) from e
        num_tokens = sum(len(ids) for ids in self.prompts)
        return {
            "id": base, "object": "list", "created": int(time.time()),
            "model": self.ctx.model_name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encode(e, self.req.encoding_format)}
                     for i, e in enumerate(embeddings)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
