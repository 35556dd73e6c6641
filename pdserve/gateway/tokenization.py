"""vLLM's POST /tokenize and POST /detokenize: the gateway's tokenizer (the engine's, with its
chat template) over HTTP, without generating."""

from __future__ import annotations

from pydantic import Field

from pdserve.gateway.protocol import ChatMessage, TemplateKwargs, _Body, bad_request
from pdserve.gateway.serving import ServingContext


class TokenizeRequest(_Body):
    """A text `prompt` (add_special_tokens defaults to true), or chat `messages` rendered with
    the chat template (add_special_tokens defaults to false, as the template has them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def tokenize(ctx: ServingContext, req: TokenizeRequest) -> dict:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt: give either prompt or messages", "prompt")
    if req.messages is not None:
        add = bool(req.add_special_tokens)
        tokens = ctx.encode_chat([m.for_template() for m in req.messages],
                                 req.add_generation_prompt, req.continue_final_message,
                                 req.chat_template_kwargs, add_special_tokens=add)
    else:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        tokens = ctx.encode(req.prompt, add_special_tokens=add)
    return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}


def vocab_size(tokenizer) -> int | None:
    """The number of token ids the tokenizer knows (added tokens included), if it says."""
    try:
        return len(tokenizer)
    except TypeError:
        return None


def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict:
    size = vocab_size(ctx.tokenizer)
    bad = [t for t in req.tokens if t < 0 or (size is not None and t >= size)]
    if bad:
        raise bad_request(f"tokens: token id {bad[0]} is out of vocabulary "
                          f"(ids are 0..{size - 1 if size is not None else 'N'})", "tokens")
    return {"prompt": ctx.decode(req.tokens)}
