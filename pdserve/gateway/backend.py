"""What the gateway needs from whatever generates: the Backend interface and the records that
cross it (deltas, usage, stats).

A backend starts a request with `await generate(...)`, which raises at once on bad input
(ValueError, naming the field) or when nothing can serve it (BackendUnavailable), and returns
a DeltaStream: the request's new tokens per completion `index`, in order. Closing a stream
before its end aborts the request, so its KV blocks are freed.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.pooling_params import PoolingParams
from pdserve.sampling_params import SamplingParams


class BackendError(Exception):
    """A request failed in the backend; `status` is the HTTP status it maps to."""

    status = 500
    type = "internal_error"
    code = "internal_error"


class BackendUnavailable(BackendError):
    """No healthy instance, or the backend cannot be reached."""

    status = 503
    type = "service_unavailable_error"
    code = "service_unavailable"


class BackendUnsupported(BackendError):
    """The request is valid but this backend cannot serve it (e.g. embeddings via a router)."""

    status = 400
    type = "invalid_request_error"
    code = None


class BackendOverloaded(BackendError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class BackendTimeout(BackendError):
    status = 504
    type = "timeout_error"
    code = "timeout"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int | None
    text: str


# One generated position's logprobs: the sampled token first, then the top ones; None when the
# backend has none for that position (a token sampled by a remote prefill without logprobs).
PositionLogprobs = list[TokenLogprob] | None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens,
                     self.completion_tokens + other.completion_tokens,
                     self.cached_tokens + other.cached_tokens)

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class ServedBy:
    """Which instances served a request (router mode)."""

    prefill_instance: str = ""
    decode_instance: str = ""
    disaggregated: bool = False
    prefill_attempts: int = 0
    kv_connector: str = ""


@dataclass
class Delta:
    """New output of completion `index`; `usage` is set on the request's last delta only."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # on the request's first delta
    prompt_logprobs: list[PositionLogprobs] | None = None  # first delta, if asked and known
    usage: Usage | None = None
    served_by: ServedBy | None = None


@dataclass(frozen=True)
class ModelInfo:
    id: str
    root: str
    max_model_len: int
    max_logprobs: int = 20  # the most logprobs a request may ask for (-1: no cap)
    # (SamplingParams field, value): the model's recommended settings, for requests that
    # leave them unset (engine/generation_defaults.py)
    sampling_defaults: tuple[tuple[str, Any], ...] = ()
    max_tokens_cap: int | None = None  # the most max_tokens a request gets (None: no cap)


@dataclass(frozen=True)
class BackendStats:
    """Load for the gauges; a cumulative counter is None when the backend does not report it."""

    running_requests: int = 0
    waiting_requests: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    prefix_queries: int | None = None
    prefix_hits: int | None = None
    kv_transfer_bytes: int | None = None
    kv_transfer_seconds: float | None = None
    prefix_index_errors: int | None = None
    # speculative decoding (a local engine with speculative_config): drafts, drafted, kept
    spec_drafts: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    instances: dict[str, int] = field(default_factory=dict)  # role -> live instances

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


class DeltaStream(abc.ABC):
    """The deltas of one request; iterate it, and close it if you stop early."""

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> Delta:
        """The next delta; raises BackendError if the request failed."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Abort the request if it has not finished (idempotent)."""


class Backend(abc.ABC):
    """Something that generates: one local engine, or the router of a cluster."""

    supports_prompt_logprobs = False  # whether deltas can carry prompt_logprobs

    @abc.abstractmethod
    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams, priority: int = 0,
                       cache_salt: str | None = None) -> DeltaStream:
        """Start a request (`priority`: vLLM's, lower first, under a priority scheduling
        policy; `cache_salt`: vLLM's prefix-cache salt). Raises ValueError on bad input,
        BackendError if it cannot run."""

    async def embed(self, request_id: str, prompt_ids: list[int],
                    pooling: PoolingParams) -> list[float]:
        """The embedding of one tokenized prompt. Raises ValueError on bad input (naming the
        field), BackendError if it cannot run (by default: not served here)."""
        raise BackendUnsupported("embeddings: not served by this backend")

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request by id (unknown ids are ignored)."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when a request could be served now."""

    @abc.abstractmethod
    def models(self) -> list[ModelInfo]:
        """The model(s) served, first the default one."""

    def load_tokenizer(self):
        """A tokenizer for the gateway's own use (chat templates, prompt lengths): by default
        the default model's, loaded from its `root`."""
        from pdserve.models.loader import load_tokenizer, resolve_model

        return load_tokenizer(resolve_model(self.models()[0].root))

    @abc.abstractmethod
    async def stats(self) -> BackendStats:
        """Current load; raises BackendError when it cannot be read."""

    async def close(self) -> None:
        """Release threads, channels, the engine."""
