"""Turns what a user submits (a prompt and SamplingParams) into validated Request records."""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping

from pdserve.block_hash import check_cache_salt
from pdserve.config import ModelConfig
from pdserve.engine.request import Request
from pdserve.engine.structured_output import StructuredOutputManager
from pdserve.kv_transfer.connector import KVHandle
from pdserve.sampling_params import SamplingParams


PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def check_prompt_keys(prompt: Mapping) -> None:
    """ValueError naming a prompt field pdserve does not serve (multimodal data, embeddings
    as input, ...) rather than generating as if it were not there."""
    for key in prompt:
        if key not in PROMPT_KEYS:
            raise ValueError(f"prompt.{key}: not supported (pdserve serves text prompts: "
                             f"{', '.join(sorted(PROMPT_KEYS))})")


def prompt_cache_salt(prompt) -> str | None:
    """The prompt's cache_salt, checked; None for a plain string or a prompt without one."""
    return check_cache_salt(prompt.get("cache_salt")) if isinstance(prompt, Mapping) else None


class InputProcessor:
    """Validates and tokenizes prompts; fans a request with n > 1 out into n child records."""

    def __init__(self, model_config: ModelConfig, tokenizer, max_len: int, block_size: int = 16):
        self.model_config = model_config
        self.block_size = block_size  # the KV cache's, to check remote KV handles against
        self.max_len = max_len  # max_model_len, or less when the KV cache holds less
        self.tokenizer = tokenizer
        self.vocab_size = model_config.arch.vocab_size
        self.eos_token_id = tokenizer.eos_token_id
        # Compiles structured_outputs constraints; the grammar's end is any stop token.
        self.grammars = StructuredOutputManager(
            tokenizer, self.vocab_size,
            [*model_config.arch.eos_token_ids, *filter(None, [self.eos_token_id])])

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A str, TextPrompt or TokensPrompt -> (prompt text or None, token ids). The length
        is checked by `make_requests`, after SamplingParams.truncate_prompt_tokens."""
        if isinstance(prompt, Mapping):
            check_prompt_keys(prompt)
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            text, ids = prompt["prompt"], None
        else:
            raise ValueError(f"prompt: expected a str, TextPrompt or TokensPrompt, "
                             f"got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt: expected a str, got {type(text).__name__}")
            ids = self.tokenizer.encode(text) if text else []
        self._check_prompt(ids)
        return text, ids

    def _check_prompt(self, ids: list[int]) -> None:
        """Not empty, and every id in the vocabulary."""
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size),
                   None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad!r} is outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def _check_length(self, ids: list[int]) -> None:
        if len(ids) >= self.max_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within "
                             f"max_model_len={self.max_len}")

    def make_requests(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      arrival_time: float | None = None, priority: int = 0,
                      kv_transfer_params: dict | None = None) -> list[Request]:
        """One Request per output sequence; child i of n > 1 is seeded with seed + i.

        `kv_transfer_params` on a decode instance: {"remote_handle": KVHandle dict or None,
        "output_token_ids": tokens already sampled by the prefill instance}.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, "
                             f"got {type(params).__name__}")
        params.verify_vocab(self.vocab_size)
        prompt_ids = params.truncate_prompt(prompt_ids, self.model_config.max_model_len)
        self._check_length(prompt_ids)
        remote_kv, prefilled = self._remote_inputs(kv_transfer_params or {}, params)
        if len(prompt_ids) + len(prefilled) >= self.max_len:
            raise ValueError(f"output_token_ids: {len(prefilled)} tokens after a "
                             f"{len(prompt_ids)}-token prompt leave no room to generate within "
                             f"max_model_len={self.max_len}")
        if remote_kv is not None:
            remote_kv.check(len(prompt_ids), self.block_size)
            if not prefilled and remote_kv.num_tokens == len(prompt_ids):
                raise ValueError("output_token_ids: needed with a handle covering the whole "
                                 "prompt (its last token is computed here, to sample from)")
        bad_words = self._tokenize_bad_words(params.bad_words or [])
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children, constant_logits = [], {}  # the children's settings are the same
        for i in range(params.n):
            child_params = params
            rid = request_id
            if params.n > 1:
                child_params = copy.copy(params)
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + i
                rid = f"{i}_{request_id}"
            child = Request(
                request_id=rid, prompt_token_ids=list(prompt_ids), sampling_params=child_params,
                eos_token_id=self.eos_token_id, priority=priority, arrival_time=arrival,
                bad_words_token_ids=bad_words, kv_transfer_params=kv_transfer_params,
                remote_kv=remote_kv, output_token_ids=list(prefilled),
                constant_logits_cache=constant_logits)
            if params.structured_outputs is not None:
                child.grammar = self.grammars.grammar_for(params.structured_outputs.spec)
            children.append(child)
        return children

    def _remote_inputs(self, kv: dict, params: SamplingParams) -> tuple[KVHandle | None,
                                                                          list[int]]:
        handle = kv.get("remote_handle")
        remote_kv = KVHandle.from_dict(handle) if handle else None
        prefilled = list(kv.get("output_token_ids") or [])
        if (remote_kv or prefilled) and params.n != 1:  # one lease: one reader
            raise ValueError("n: must be 1 for a request continuing a remote prefill")
        if (remote_kv or prefilled) and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not computed for a request continuing a "
                             "remote prefill (the prefill side has them)")
        for t in prefilled:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"output_token_ids: token id {t!r} is outside the vocabulary")
        if params.max_tokens is not None and len(prefilled) >= params.max_tokens:
            raise ValueError("output_token_ids: already as many as max_tokens")
        return remote_kv, prefilled

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        out: dict[tuple[int, ...], None] = {}  # in order, once each
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids:
                    out[tuple(ids)] = None
        return [list(ids) for ids in out]
