"""What generation returns: per-token logprobs, one completion, and a request's outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """The log probability of one token, its 1-based rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """When a request reached each stage (wall clock, `time.time()` seconds; None until then)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


# One dict per generated position: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt position; the first is None (no token precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """The output data of one completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={list(self.token_ids)}, cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
                f"stop_reason={self.stop_reason!r})")


@dataclass
class RequestOutput:
    """The output data of a completion request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    lora_request: Any | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None  # why a request ended with finish_reason "error"

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one: with `aggregate`, append
        each completion's new text, tokens and logprobs (DELTA outputs); else replace it."""
        self.finished |= next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params
        self.metrics = next_output.metrics
        for new in next_output.outputs:
            old_pos = next((i for i, c in enumerate(self.outputs) if c.index == new.index), None)
            if old_pos is None:
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[old_pos] = new
            else:
                old = self.outputs[old_pos]
                old.text += new.text
                old.token_ids = list(old.token_ids) + list(new.token_ids)
                if new.logprobs:
                    old.logprobs = (old.logprobs or []) + new.logprobs
                old.cumulative_logprob = new.cumulative_logprob
                old.finish_reason = new.finish_reason
                old.stop_reason = new.stop_reason

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, "
                f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
                f"finished={self.finished}, metrics={self.metrics}, "
                f"num_cached_tokens={self.num_cached_tokens}, "
                f"kv_transfer_params={self.kv_transfer_params})")


@dataclass
class PoolingOutput:
    """The pooled output of one prompt: `data`, a tensor (an embedding for embed)."""

    data: Any  # torch.Tensor (float32, on the CPU)


@dataclass
class PoolingRequestOutput:
    """The output data of a pooling request (LLM.encode)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None


@dataclass
class EmbeddingOutput:
    """One embedding: a list of floats, of length `hidden_size` (or the `dimensions` asked)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The output data of an embedding request (LLM.embed)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()),
                   out.prompt_token_ids, out.finished, out.num_cached_tokens, out.prompt)
