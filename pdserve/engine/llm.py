"""LLM: vLLM's offline API (`generate`, `chat`) over one in-process LLMEngine."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tqdm.auto import tqdm

from pdserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, run_beam_search
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.metrics_reader import Metric
from pdserve.engine.pooling import add_pooling_prompts, to_embedding_outputs
from pdserve.engine.vllm_args import load_chat_template, refuse_unsupported
from pdserve.models.loader import DEFAULT_MODEL
from pdserve.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from pdserve.pooling_params import PoolingParams
from pdserve.sampling_params import RequestOutputKind, SamplingParams


UseTqdm = bool | Callable[..., Any]
# How chat templates see message content: pdserve joins text parts into one string, which
# every template accepts, whatever the format asked for.
CONTENT_FORMATS = frozenset({"auto", "string", "openai"})


class LLM:
    """An LLM for generating texts from prompts, batching them continuously.

    Keyword arguments are EngineArgs fields: pdserve's (kv_cache_memory_bytes, ...) and
    vLLM's (dtype, seed, tokenizer, chat_template, max_logprobs, enforce_eager, ...); see the
    README for what each vLLM argument does here.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any):
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._enqueued: list[str] = []  # enqueue()d ids, for wait_for_completion
        self._completed: dict[str, RequestOutput] = {}  # their outputs, once finished

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended settings (its generation config, as
        vLLM reads it), else SamplingParams()."""
        return SamplingParams(**dict(self.llm_engine.config.model.sampling_defaults))

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: UseTqdm = True, lora_request: Any = None,
                 priority: int | Sequence[int] | None = None,
                 tokenization_kwargs: dict | None = None,
                 mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate completions for one prompt or a list; outputs keep the input order.

        `priority` (with scheduling_policy="priority"; lower runs first): an int for every
        prompt, or a list with one per prompt. `use_tqdm` may be a callable that makes the
        progress bar (as tqdm does). LoRA, tokenization and multimodal options are vLLM's
        arguments for what pdserve does not do: None (or empty) only.
        """
        refuse_unsupported(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs,
                           mm_processor_kwargs=mm_processor_kwargs)
        return self._run(self._add_prompts(prompts, sampling_params, priority), use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams]
              | None = None, use_tqdm: bool = True, *,
              truncate_prompt_tokens: int | None = None,
              priority: int | Sequence[int] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`): the final hidden state of its last
        token, L2-normalized unless pooling_params.normalize is False (engine/pooling.py)."""
        return to_embedding_outputs(self.encode(
            prompts, pooling_params, use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens,
            priority=priority))

    def encode(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams]
               | None = None, use_tqdm: bool = True, *,
               truncate_prompt_tokens: int | None = None, pooling_task: str | None = None,
               priority: int | Sequence[int] | None = None) -> list[PoolingRequestOutput]:
        """Pooled outputs (`.outputs.data`, a tensor) for one prompt or a list; only the
        "embed" pooling task is served."""
        if pooling_task not in (None, "embed"):
            raise ValueError(f"pooling_task: only 'embed' is supported, got {pooling_task!r}")
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            pooling_params = _params_list("pooling_params", pooling_params, PoolingParams)
        if truncate_prompt_tokens is not None:
            base = pooling_params if pooling_params is not None else PoolingParams()
            pooling_params = [PoolingParams(p.normalize, p.dimensions, truncate_prompt_tokens)
                              for p in ([base] if isinstance(base, PoolingParams) else base)]
            if len(pooling_params) == 1:
                pooling_params = pooling_params[0]
        prompts = _prompt_list(prompts)
        ids = add_pooling_prompts(self.llm_engine, prompts, pooling_params,
                                  _priorities(priority, len(prompts)))
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search (pdserve/beam_search.py) for each prompt (str, TextPrompt or
        TokensPrompt); each step runs every live beam of every prompt as one batch."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        prompts = _prompt_list(prompts)
        engine = self.llm_engine
        max_logprobs = engine.config.model.max_logprobs
        if max_logprobs != -1 and 2 * params.beam_width > max_logprobs:
            raise ValueError(f"beam_width: a search of width {params.beam_width} reads "
                             f"{2 * params.beam_width} logprobs a step, more than "
                             f"max_logprobs={max_logprobs} (an engine argument)")
        tokenizer = self.get_tokenizer()
        searches = []
        for prompt in prompts:
            _, ids = engine.input_processor.tokenize_prompt(prompt)
            if len(ids) + params.max_tokens > engine.scheduler.max_model_len:
                raise ValueError(f"max_tokens: {len(ids)} prompt tokens + {params.max_tokens} "
                                 f"exceed max_model_len={engine.scheduler.max_model_len}")
            searches.append(BeamSearch(ids, params, tokenizer.eos_token_id))
        step = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                              temperature=params.temperature, ignore_eos=True)

        def next_token_logprobs(batch: list[list[int]]) -> list[dict[int, float]]:
            outs = self.generate([{"prompt_token_ids": ids} for ids in batch], step,
                                 use_tqdm=False)
            return [{t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
                    for out in outs]

        return run_beam_search(searches, next_token_logprobs, tokenizer.decode)

    def enqueue(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams]
                | None = None, lora_request: Any = None,
                priority: int | Sequence[int] | None = None, use_tqdm: UseTqdm = True,
                tokenization_kwargs: dict | None = None,
                mm_processor_kwargs: dict | None = None) -> list[str]:
        """Queue prompts without running them; returns their request ids (see
        wait_for_completion)."""
        refuse_unsupported(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs,
                           mm_processor_kwargs=mm_processor_kwargs)
        ids = self._add_prompts(prompts, sampling_params, priority)
        self._enqueued.extend(ids)
        return ids

    def wait_for_completion(self, output_type: Any = None, *,
                            use_tqdm: UseTqdm = True) -> list[RequestOutput]:
        """Run every queued request to the end; returns the enqueued ones' outputs in the
        order they were enqueued."""
        ids = self._enqueued
        outputs = self._run(ids, use_tqdm)
        self._enqueued, self._completed = [], {}
        return outputs

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Forget the prefix cache; False when blocks are still in use. Running requests are
        never reset here, and connectors keep no cache: both flags must stay False."""
        refuse_unsupported(reset_running_requests=reset_running_requests or None,
                           reset_connector=reset_connector or None)
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's metrics (vLLM's Counter and Gauge objects)."""
        return self.llm_engine.get_metrics()

    def sleep(self, level: int = 1) -> None:
        """Level 1: abort requests and free the KV cache; level 2: free the weights too."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what sleep freed (weights reload from the checkpoint)."""
        self.llm_engine.wake_up(tags)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams]
             | None = None, use_tqdm: UseTqdm = True, lora_request: Any = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tokenization_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None,
             priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Apply the chat template (`chat_template`: a Jinja template or a file holding one;
        default: the engine's `chat_template` argument, else the model's) to one conversation
        or a list, then generate. `content` may be a string or OpenAI text parts; `tools`
        (OpenAI function tools) are passed to the template, as are assistant `tool_calls`
        (their JSON `arguments` as objects) and `tool` messages."""
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format: expected one of "
                             f"{sorted(CONTENT_FORMATS)}, got {chat_template_content_format!r}")
        refuse_unsupported(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs,
                           mm_processor_kwargs=mm_processor_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        prompts = [{"prompt_token_ids": self.apply_chat_template(
            c, chat_template, add_generation_prompt, continue_final_message,
            chat_template_kwargs)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, priority=priority)

    def apply_chat_template(self, conversation: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the (model's) chat template."""
        conversation = [_text_message(i, m) for i, m in enumerate(conversation)]
        tokenizer = self.get_tokenizer()
        text = tokenizer.apply_chat_template(
            conversation, chat_template=load_chat_template(chat_template), tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        return tokenizer.encode(text, add_special_tokens=False)

    def _add_prompts(self, prompts, sampling_params, priority) -> list[str]:
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = _params_list("sampling_params", sampling_params, SamplingParams)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for "
                                 f"{len(prompts)} prompts")
        return self._add_all(prompts, params, _priorities(priority, len(prompts)))

    def _add_all(self, prompts: list, params: list[SamplingParams],
                 priority: list[int] | None) -> list[str]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params: expected SamplingParams, "
                                     f"got {type(p).__name__}")
                p = p.clone()
                p.output_kind = RequestOutputKind.FINAL_ONLY
                rid = engine.next_request_id()
                engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: UseTqdm) -> list[RequestOutput]:
        engine = self.llm_engine
        done = self._completed  # also keeps enqueued requests that finish during generate()
        wanted, keep = set(ids), set(ids) | set(self._enqueued)
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in keep:
                        done[out.request_id] = out
                        bar.update(out.request_id in wanted)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return [done.pop(i) for i in ids if i in done]


def _prompt_list(prompts: Any) -> list:
    """vLLM's `prompts` argument (a prompt, or a list of them) as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise ValueError(f"prompts: expected a string, a prompt dict or a list of them, got "
                         f"{type(prompts).__name__}")
    return list(prompts)


def _params_list(name: str, params: Any, kind: type) -> list:
    """A list of `kind` (SamplingParams, PoolingParams), one per prompt."""
    if not isinstance(params, Iterable) or isinstance(params, (str, dict)):
        raise ValueError(f"{name}: expected {kind.__name__} or a list of them, got "
                         f"{type(params).__name__}")
    return list(params)


def _priorities(priority: int | Sequence[int] | None, count: int) -> list[int] | None:
    """One priority per prompt from vLLM's `priority` argument (an int applies to all)."""
    if priority is None:
        return None
    values = [priority] * count if isinstance(priority, int) else list(priority)
    if len(values) != count:
        raise ValueError(f"priority: {len(values)} given for {count} prompts")
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"priority: must be an int or a list of ints, got {value!r}")
    return values


def _text_message(i: int, message: Any) -> dict:
    """A chat message with its `content` as one string (OpenAI text parts joined by "\\n")
    and its tool calls' JSON `arguments` parsed into objects, as chat templates expect."""
    if not isinstance(message, dict) or "role" not in message or (
            "content" not in message and "tool_calls" not in message):
        raise ValueError(f"messages[{i}]: needs 'role' and 'content'")
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [_template_call(i, c) for c in message["tool_calls"]]}
    content = message.get("content")
    if content is None:  # an assistant's tool-call turn, say: templates read a string
        return {**message, "content": ""}
    if isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content: must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" \
                and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported, "
                             f"got {kind!r}")
    return {**message, "content": "\n".join(texts)}


def _template_call(i: int, call: Any) -> dict:
    """An OpenAI tool call with its `arguments` (JSON text) as an object when it parses."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"messages[{i}].tool_calls: each needs function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {**call, "function": {**function, "arguments": arguments}}
