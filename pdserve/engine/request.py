"""The request record: one object carries a request from admission to its last token.

Only the scheduler changes the counters (`num_computed_tokens`, status) and appends sampled
tokens (`append_output_token`), with one exception: the output processor ends a request at a
stop string, which may drop tokens after it that the same step appended (kept drafts,
ngram_drafts.py). The block pool and KV cache manager read it but never write it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pdserve.block_hash import ROOT_HASH
from pdserve.engine.constant_logits import ConstantLogits

if TYPE_CHECKING:
    from pdserve.engine.ngram_drafts import NgramDrafts
    from pdserve.engine.structured_output import GrammarState
    from pdserve.kv_transfer.connector import KVHandle
    from pdserve.pooling_params import PoolingParams
    from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is. Values above RUNNING are finished states."""

    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence being generated (a parent with n > 1 fans out into n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Pre-tokenized `sampling_params.bad_words` (each word with and without a leading space).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Disaggregation: {"do_remote_decode": True} on a prefill instance; on a decode instance
    # `remote_kv` says where the prompt's KV blocks are.
    kv_transfer_params: dict[str, Any] | None = None
    remote_kv: KVHandle | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until then
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None  # why a FINISHED_ERROR request failed
    pending_remote_tokens: int = 0  # tokens a remote KV load in flight will provide
    # Chained hashes of this request's full blocks (prompt and output), see block_hash.py,
    # from `hash_root` (ROOT_HASH, or the prompt's cache_salt's).
    block_hashes: list[int] = field(default_factory=list)
    hash_root: int = ROOT_HASH
    # Structured outputs: where this sequence is in its grammar (None: unconstrained).
    grammar: GrammarState | None = None
    # Embeddings: pool the last prompt token's hidden state instead of sampling (pooling.py).
    pooling_params: PoolingParams | None = None
    # Speculative decoding: this sequence's n-gram index, once it decodes (ngram_drafts.py).
    drafts: NgramDrafts | None = None
    # Its allowed_token_ids and logit_bias as tensors by (vocabulary size, device), built on
    # first use; one dict for the n sequences of a request, whose settings are the same.
    constant_logits_cache: dict[tuple[int, torch.device], ConstantLogits] = field(
        default_factory=dict, repr=False)

    def constant_logits(self, vocab: int, device: torch.device) -> ConstantLogits:
        """Its allowed_token_ids and logit_bias as tensors (constant_logits.py)."""
        cache = self.constant_logits_cache
        if (vocab, device) not in cache:
            cache[vocab, device] = ConstantLogits.build(self.sampling_params, vocab, device)
        return cache[vocab, device]

    def next_draw_generator(self) -> torch.Generator | None:
        """The generator of this sequence's next random draw; None when it has no seed. It
        depends on (seed, output position) only, so a sequence continued on another instance
        draws there what it would have drawn here, without replaying the draws before."""
        seed = self.sampling_params.seed
        if seed is None:
            return None
        return torch.Generator().manual_seed(_mix64(seed, self.num_output_tokens))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)


def _mix64(seed: int, position: int) -> int:
    """64 well-mixed bits of (seed, position): splitmix64's finalizer over a combination."""
    z = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


_MASK64 = (1 << 64) - 1
