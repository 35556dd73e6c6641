"""OpenAI request bodies (with vLLM's extra sampling fields) and their SamplingParams.

Types are checked by pydantic; values by SamplingParams, whose ValueErrors name the field.
Unknown fields are ignored (and logged once per name by the app), as in vLLM.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from pdserve import untrusted_json
from pdserve.block_hash import MAX_CACHE_SALT_CHARS
from pdserve.beam_search import BeamSearchParams
from pdserve.sampling_params import WIRE_LIMITS, SamplingParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_TOOLS = 128  # OpenAI's bound on a request's tools
# apply_chat_template's own arguments. A request's chat_template_kwargs may only add variables
# for the template: a `chat_template` among them would render the caller's Jinja here.
_TEMPLATE_ARGUMENTS = frozenset({
    "chat_template", "conversation", "messages", "tools", "documents", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length"})


def _template_variables(value: dict[str, Any] | None) -> dict[str, Any] | None:
    reserved = sorted(set(value or ()) & _TEMPLATE_ARGUMENTS)
    if reserved:
        raise ValueError(f"{', '.join(reserved)}: not settable here (only the chat template's "
                         f"variables are)")
    return value


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_variables)]


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _clamped(logit_bias: dict[str, float] | None) -> dict[str, float] | None:
    """Biases clamped to [-100, 100] as OpenAI's API defines them (vLLM clamps too); NaN and
    infinities are left for SamplingParams to refuse."""
    return logit_bias and {token: min(100.0, max(-100.0, v)) if math.isfinite(v) else v
                           for token, v in logit_bias.items()}


def _check_logprobs(name: str, value: int | None, max_logprobs: int) -> None:
    if value is not None and max_logprobs != -1 and value > max_logprobs:
        raise bad_request(f"{name}: {value} requested, more than max_logprobs={max_logprobs} "
                          f"(a server option)", name)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk (with include_usage)


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format, and vLLM's structural_tag form of it."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict] | None = None
    triggers: list[str] | None = None
    format: dict | None = None


class _SamplingRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    # vLLM's: logprobs name tokens "token_id:<id>" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, le=WIRE_LIMITS["n"])  # a beam search's width too
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_token_ids: bool | None = None  # vLLM: generated (and prompt) token ids in the answer
    use_beam_search: bool = False  # vLLM: the n best beams of a beam search (beam_stream.py)
    priority: int = 0  # vLLM: lower first, with --scheduling-policy priority (else only 0)
    # vLLM: the prompt's prefix-cache blocks match only requests with the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    length_penalty: float = 1.0
    truncate_prompt_tokens: int | None = None  # vLLM: keep the last k prompt tokens (-1: all fit)
    # Structured outputs (constraints.py): one of these at most.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  prompt_logprobs: int | None = None, tool_schema: dict | None = None,
                  defaults: dict | None = None) -> SamplingParams:
        """`defaults`: the model's recommended settings, for the optional fields left unset."""
        from pdserve.gateway.constraints import requested_constraint

        structured = requested_constraint(self, tool_schema)
        given = (("temperature", self.temperature), ("top_p", self.top_p),
                 ("top_k", self.top_k), ("min_p", self.min_p),
                 ("repetition_penalty", self.repetition_penalty))
        optional = {k: v if v is not None else (defaults or {}).get(k) for k, v in given}
        optional = {k: v for k, v in optional.items() if v is not None}
        try:
            params = SamplingParams(
                n=self.n, max_tokens=max_tokens, stop=self.stop, seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, logit_bias=_clamped(self.logit_bias),
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                stop_token_ids=self.stop_token_ids,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                structured_outputs=structured, **optional)
            params.verify_wire_limits()
        except ValueError as e:
            raise bad_request(str(e), param_of(str(e))) from e
        return params

    def beam_search_params(self, max_tokens: int, logprobs: int | None,
                           max_logprobs: int) -> BeamSearchParams | None:
        """use_beam_search's parameters (beam width n), or None; APIError 400 naming the
        field when the request cannot be a beam search."""
        if not self.use_beam_search:
            return None
        from pdserve.gateway.constraints import requested_constraint

        if requested_constraint(self, getattr(self, "tool_schema", None)) is not None:
            raise bad_request("use_beam_search: not available with structured outputs or "
                              "tool_choice", "use_beam_search")
        if logprobs is not None:
            raise bad_request("logprobs: not available with use_beam_search", "logprobs")
        if max_logprobs != -1 and 2 * self.n > max_logprobs:
            raise bad_request(f"n: a beam search of width {self.n} reads {2 * self.n} logprobs "
                              f"per step, more than max_logprobs={max_logprobs}", "n")
        try:
            return BeamSearchParams(
                beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                temperature=self.temperature or 0.0, length_penalty=self.length_penalty,
                include_stop_str_in_output=self.include_stop_str_in_output)
        except ValueError as e:  # the beam width is the request's n
            head = str(e).split(" ", 1)[0]
            raise bad_request(str(e), "n" if head == "beam_width" else head) from e

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk: vLLM's continuous_usage_stats, which (as in vLLM)
        takes effect only together with include_usage."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def truncate(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (all when unset); 400 naming the
        field when the value is bad or above the model's context length."""
        try:
            params = SamplingParams(truncate_prompt_tokens=self.truncate_prompt_tokens)
            return params.truncate_prompt(prompt_ids, max_model_len)
        except ValueError as e:
            raise bad_request(str(e), "truncate_prompt_tokens") from e


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise bad_request("prompt: must not be empty", "prompt")
        return prompts

    def sampling_params(self, max_tokens: int | None, max_logprobs: int = MAX_LOGPROBS,
                        defaults: dict | None = None) -> SamplingParams:
        """The request's SamplingParams (`defaults` for the optional settings it leaves
        unset); APIError 400 naming the field when one is bad."""
        _check_logprobs("logprobs", self.logprobs, max_logprobs)
        _check_logprobs("prompt_logprobs", self.prompt_logprobs, max_logprobs)
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs: not available when stream is true",
                              "prompt_logprobs")
        if self.suffix is not None:
            raise bad_request("suffix: not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of: only best_of == n is supported, got {self.best_of}",
                              "best_of")
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
                 if k is not None]
        prompt_logprobs = max(asked) if asked else None
        return self._sampling(max_tokens, self.logprobs, prompt_logprobs, defaults=defaults)


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"


class ToolCallMessage(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        try:
            arguments = untrusted_json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


class TextPart(_Body):
    type: Literal["text"]
    text: str


def _text_parts_only(content: Any) -> Any:
    """A content list's parts must be text: name the type of one that is not."""
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ValueError(f"only text parts are supported, got a part of type {kind!r}")
    return content


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts_only)] = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: tool-call arguments as objects (their
        JSON text parsed), as transformers' tool-use templates expect."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = None
    prompt_logprobs: int | None = Field(default=None, ge=0)  # vLLM's extra field

    def sampling_params(self, max_tokens: int | None, max_logprobs: int = MAX_LOGPROBS,
                        defaults: dict | None = None) -> SamplingParams:
        """The request's SamplingParams (`defaults` for the optional settings it leaves
        unset); APIError 400 naming the field when one is bad."""
        _check_logprobs("top_logprobs", self.top_logprobs, max_logprobs)
        _check_logprobs("prompt_logprobs", self.prompt_logprobs, max_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs: not available when stream is true",
                              "prompt_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, self.prompt_logprobs,
                              tool_schema=self.tool_schema, defaults=defaults)

    @property
    def effective_tool_choice(self) -> str | dict:
        """tool_choice as given, checked; "auto" when tools come without one (as OpenAI)."""
        from pdserve.gateway.tool_parsers import validate_tools

        try:
            validate_tools(self.tools or None, self.tool_choice)
        except ValueError as e:
            raise bad_request(str(e), str(e).split(":", 1)[0]) from e
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def tool_schema(self) -> dict | None:
        """The JSON schema the output must match for tool_choice "required" (a list of
        calls) or a named function (its arguments); None otherwise."""
        from pdserve.gateway.tool_parsers import required_tools_schema

        choice = self.effective_tool_choice
        if choice == "required":
            return required_tools_schema(self.tools)
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            tool = next(t["function"] for t in self.tools if t["function"]["name"] == name)
            return tool.get("parameters") or {"type": "object", "properties": {}}
        return None

    @property
    def requested_max_tokens(self) -> int | None:
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)


_PARAM_ALIASES = {"max_tokens", "min_tokens", "n", "temperature", "top_p", "top_k", "min_p",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
                  "stop_token_ids", "logprobs", "prompt_logprobs", "logit_bias",
                  "allowed_token_ids", "bad_words", "prompt", "prompt_token_ids",
                  "truncate_prompt_tokens", "priority", "cache_salt", "length_penalty"}


def param_of(message: str) -> str | None:
    """The request field a SamplingParams / engine error message starts with, if any."""
    head = message.replace(":", " ").split(" ", 1)[0]
    if head == "prompt_token_ids":
        return "prompt"
    return head if head in _PARAM_ALIASES else None
