"""Sampling parameters for text generation, with vLLM's field names, defaults and checks."""

from __future__ import annotations

import copy
import enum
import logging
import math
import struct
from dataclasses import dataclass
from typing import Any

from pdserve.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)
_FLOAT32_MAX = 3.4028234663852886e38

# The most one request that crosses a process boundary (HTTP, gRPC) may ask for: sequences
# (n: OpenAI's bound) and items of the lists checked at every generated token. In-process
# callers of LLM/LLMEngine are not bounded.
WIRE_LIMITS = {"n": 128, "stop": 128, "stop_token_ids": 1024, "bad_words": 1024}
MAX_BAD_WORD_CHARS = 256  # each is tokenized on the engine's thread, twice
_SAMPLING_EPS = 1e-5
_MIN_TEMP = 1e-2


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput carries: everything so far, only the new part, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(name: str, value: Any) -> float:
    """`value` as a float; ValueError naming `name` if it is not a number, or NaN or ±inf
    (which would poison the logits: vLLM advisory GHSA-7h4p-rffg-7823)."""
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _float32(value: float) -> float | None:
    """`value` rounded to float32 as the logits hold it; None where that overflows."""
    if abs(value) > _FLOAT32_MAX:
        return None
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _parse_token_id(key: Any) -> int | None:
    """An int key as is, a str key such as "50256" (OpenAI sends those) as its int, else None."""
    if _is_int(key):
        return key
    if isinstance(key, str):
        try:
            return int(key.strip())
        except ValueError:
            return None
    return None


def _int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple, set)):
        raise ValueError(f"{name} must be a list of ints, got {value!r}")
    for item in value:
        if not _is_int(item) or item < 0:
            raise ValueError(f"{name} must contain non-negative ints, got {item!r}")
    return list(value)


@dataclass
class SamplingParams:
    """Sampling parameters for text generation (OpenAI completion semantics, as in vLLM).

    Invalid values raise ValueError naming the field and the value. `top_k=-1` is stored as 0
    (all tokens), a string `stop` becomes a one-element list, `stop_token_ids=None` becomes [].
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None
    # Keep only the last k prompt tokens (-1: the model's max_model_len); None keeps all.
    truncate_prompt_tokens: int | None = None
    # vLLM: also return the logprobs of these token ids at every generated position.
    logprob_token_ids: list[int] | None = None
    # vLLM: a flat logprobs container; accepted, the usual list of dicts is returned.
    flat_logprobs: bool = False

    def __post_init__(self) -> None:
        self._normalize()
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Zero temperature means greedy: the filters cannot change the argmax.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")

    def _normalize(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop_token_ids = (
            [] if self.stop_token_ids is None else _int_list("stop_token_ids", self.stop_token_ids)
        )
        if self.top_k == -1:
            self.top_k = 0
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            setattr(self, name, _finite(name, getattr(self, name)))
        if 0 < self.temperature < _MIN_TEMP:
            logger.warning("temperature %s is below %s; raised to %s to avoid inf/nan",
                           self.temperature, _MIN_TEMP, _MIN_TEMP)
            self.temperature = _MIN_TEMP
        if self.logit_bias is not None:
            self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:  # at most the vocabulary once deduplicated
            self.allowed_token_ids = list(dict.fromkeys(
                _int_list("allowed_token_ids", self.allowed_token_ids)))
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(dict.fromkeys(
                _int_list("logprob_token_ids", self.logprob_token_ids)))
            if self.logprob_token_ids and self.logprobs is None:
                self.logprobs = 0  # the sampled token's, plus these
        kind = self.output_kind
        if isinstance(kind, int) and not isinstance(kind, RequestOutputKind):
            if kind not in (0, 1, 2):
                raise ValueError(f"output_kind must be 0, 1 or 2, got {kind!r}")
            self.output_kind = RequestOutputKind(kind)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    @staticmethod
    def _normalize_logit_bias(bias: Any) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            token_id = _parse_token_id(key)
            if token_id is None:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if token_id < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id}")
            if not _is_number(value) or not math.isfinite(value) or _float32(value) is None:
                raise ValueError(f"logit_bias values must be finite float32 numbers, got "
                                 f"{value!r} for token {token_id}")
            out[token_id] = float(value)
        return out

    def _verify_args(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int of at least 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0 or not _float32(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a positive float32 number (from "
                             f"1.4e-45 to 3.4e38), got {self.repetition_penalty}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(
                f"top_k must be -1 or 0 (disable) or a positive int, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 63):
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int of at least 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative int, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise ValueError(
                    f"{name} must be a non-negative int, -1 (full vocab) or None, got {value!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (the model's max length), "
                             f"an int of at least 1 or None, got {k!r}")
        if not isinstance(self.flat_logprobs, bool):
            raise ValueError(f"flat_logprobs must be a bool, got {self.flat_logprobs!r}")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if not s:
                raise ValueError(f"stop cannot contain an empty string, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop strings are only supported when detokenize is True, got stop={self.stop!r} "
                "with detokenize=False")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError(f"allowed_token_ids must not be empty, got {self.allowed_token_ids!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")

    def verify_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a token id in logit_bias / allowed_token_ids / stop_token_ids is
        outside [0, vocab_size), or if allowed_token_ids is an empty list."""
        fields = {
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": self.allowed_token_ids or [],
            "stop_token_ids": self.stop_token_ids or [],
            "logprob_token_ids": self.logprob_token_ids or [],
        }
        for name, ids in fields.items():
            for token_id in ids:
                if not 0 <= token_id < vocab_size:
                    raise ValueError(
                        f"{name} contains out-of-vocab token id {token_id} "
                        f"(vocab size {vocab_size})")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError(f"allowed_token_ids must not be empty, got {self.allowed_token_ids!r}")

    def verify_wire_limits(self) -> None:
        """Raise ValueError naming the field if a request from another process asks for more
        than WIRE_LIMITS allows."""
        for name, limit in WIRE_LIMITS.items():
            value = getattr(self, name)
            count = value if name == "n" else len(value or ())
            if count > limit:
                raise ValueError(f"{name}: at most {limit} per request, got {count}")
        longest = max(map(len, self.bad_words or ()), default=0)
        if longest > MAX_BAD_WORD_CHARS:
            raise ValueError(f"bad_words: at most {MAX_BAD_WORD_CHARS} characters a word, got "
                             f"{longest}")

    def verify_max_logprobs(self, max_logprobs: int, vocab_size: int) -> None:
        """Raise ValueError if logprobs, prompt_logprobs or logprob_token_ids asks for more
        than `max_logprobs` per position (-1 asks for the whole vocabulary; `max_logprobs=-1`
        means no cap)."""
        if max_logprobs == -1:
            return
        if len(self.logprob_token_ids or ()) > max_logprobs:
            raise ValueError(f"logprob_token_ids: {len(self.logprob_token_ids)} ids, more than "
                             f"max_logprobs={max_logprobs} (an engine option)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (vocab_size if value == -1 else value) > max_logprobs:
                raise ValueError(f"{name}: {value} requested, more than max_logprobs="
                                 f"{max_logprobs} (an engine option)")

    def verify_truncation(self, max_model_len: int) -> None:
        """Raise ValueError if truncate_prompt_tokens keeps more tokens than the model's
        context holds (as vLLM)."""
        k = self.truncate_prompt_tokens
        if k is not None and k > max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {k} is greater than max_model_len="
                             f"{max_model_len}")

    def truncate_prompt(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the engine runs it: its last truncate_prompt_tokens tokens (-1:
        the last max_model_len), or all of it when truncate_prompt_tokens is None."""
        k = self.truncate_prompt_tokens
        if k is None:
            return list(prompt_ids)
        self.verify_truncation(max_model_len)
        k = max_model_len if k == -1 else k
        return list(prompt_ids[-k:])

    def clone(self) -> SamplingParams:
        """A deep copy."""
        return copy.deepcopy(self)

    @property
    def all_stop_token_ids(self) -> set[int]:
        """The ids that end generation besides EOS (the engine adds EOS unless ignore_eos)."""
        return set(self.stop_token_ids or ())

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a streamed text may hold back because they could begin a stop string."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0
