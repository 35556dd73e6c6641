"""The scheduler: decides which requests run each step and how many tokens each computes.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: every running request's
computed-token count catches up to its token count, within a per-step token budget. When the
pool runs out of blocks the lowest-priority running request is preempted (its blocks freed, to
be recomputed later). Only the scheduler changes a request's counters and status.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.block_hash import extend_block_hashes
from pdserve.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import SampleResult


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, from position `start`, to compute this step."""

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class ModelRunnerOutput:
    """What one model step produced, keyed by request id."""

    sampled: dict[str, SampleResult] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, tuple[float, int]]]] = field(default_factory=dict)


class Scheduler:
    """Continuous batching over a waiting queue and a running list."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int,
                 stop_token_ids: Iterable[int] = ()):
        self.config = config
        self.kv = kv_manager
        self.block_size = kv_manager.block_size
        # NOTE: a sequence may never outgrow the whole cache, or it could never be scheduled.
        self.max_model_len = min(max_model_len, kv_manager.pool.num_blocks * self.block_size)
        self.eos_ids = frozenset(stop_token_ids)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # --- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, or a stop string found by the detokenizer); free their blocks."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this loop
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n <= 0:
                continue
            while self.kv.allocate_slots(request, n) is None:
                victim = self._pick_victim()
                if victim.request_id in scheduled:  # undo its chunk: its blocks are going
                    chunk = next(c for c in out.chunks if c.request is victim)
                    out.chunks.remove(chunk)
                    scheduled.discard(victim.request_id)
                    budget += chunk.num_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.chunks.append(self._chunk(request, n))
                scheduled.add(request.request_id)
                budget -= n
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                break
            computed, num_cached = self.kv.get_computed_blocks(request)
            n = request.num_tokens - num_cached
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if self.kv.allocate_slots(request, n, computed) is None:
                break
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            out.chunks.append(self._chunk(request, n))
            budget -= n

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        return ScheduledChunk(request, request.num_computed_tokens, n,
                              self.kv.get_block_table(request.request_id))

    def _next_waiting(self) -> Request:
        if self.config.policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return self.waiting[0]

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)

    # --- after the model ran ---------------------------------------------------------------

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance counters, append sampled tokens, stop what must stop.

        Returns the requests that got a new token or finished this step.
        """
        touched = []
        for chunk in sched.chunks:
            request = chunk.request
            if request.is_finished:
                continue
            request.num_computed_tokens += chunk.num_tokens
            sample = result.sampled.get(request.request_id)
            if sample is not None:
                request.append_output_token(sample.token_id)
                extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
                self._check_stop(request)
                touched.append(request)
            elif request.request_id in result.prompt_logprobs:
                touched.append(request)
            self.kv.cache_blocks(request)
            if request.is_finished:
                self.running.remove(request)
                self._free(request)
        return touched

    def _check_stop(self, request: Request) -> None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and (token == request.eos_token_id or token in self.eos_ids):
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return
        max_tokens = params.max_tokens or self.max_model_len
        if request.num_output_tokens >= max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
