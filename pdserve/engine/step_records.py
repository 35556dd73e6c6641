"""The records one engine step passes along: the chunks the scheduler picked
(`SchedulerOutput`) and what the model made of them (`ModelRunnerOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.request import Request
from pdserve.engine.sampler import PromptLogprobChunk, SampleResult

if TYPE_CHECKING:
    import torch


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, from position `start`, to compute this step; the
    last `len(draft_token_ids)` of them are drafts that follow its known tokens."""

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # ended before running (KV load)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class ModelRunnerOutput:
    """What one model step produced, keyed by request id."""

    sampled: dict[str, SampleResult] = field(default_factory=dict)
    # Drafts the model confirmed, which come before the sampled token (ngram_drafts.py).
    accepted: dict[str, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobChunk] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # pooling requests' results
