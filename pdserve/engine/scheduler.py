"""The scheduler: decides which requests run each step and how many tokens each computes.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: every running request's
computed-token count catches up to its token count, within a per-step token budget; a decoding
request may add draft tokens after its last one (ngram_drafts.py). When the pool runs out of
blocks the lowest-priority running request is preempted (its blocks freed, to be recomputed
later). Only the scheduler changes a request's counters and status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from pdserve.block_hash import extend_block_hashes
from pdserve.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.ngram_drafts import propose_drafts
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.step_records import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from pdserve.kv_transfer.connector import KVConnector, LoadResult

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching over a waiting queue and a running list."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int,
                 stop_token_ids: Iterable[int] = (), connector: KVConnector | None = None):
        self.config = config
        self.kv = kv_manager
        self.connector = connector or KVConnector()
        self.loading: dict[str, Request] = {}  # remote KV loads in flight
        self.load_results: list[LoadResult] = []  # finished loads, for metrics
        # Their totals, kept as they come (load reports read them every step).
        self.kv_bytes_received, self.kv_transfer_seconds, self.kv_loads_failed = 0, 0.0, 0
        self.block_size = kv_manager.block_size
        # NOTE: a sequence may never outgrow the whole cache, or it could never be scheduled.
        self.max_model_len = min(max_model_len, kv_manager.pool.num_blocks * self.block_size)
        self.eos_ids = frozenset(stop_token_ids)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Tokens appended to outputs; with drafts: drafts verified, their tokens, and those kept.
        self.num_output_tokens = 0
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    # --- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.hash_root)
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
            if request.request_id not in self.loading:  # NOTE: a reader may still write them
                self._free(request)
            finished.append(request)
        return finished

    def release_kv(self, request_id: str) -> bool:
        """A remote reader is done with a finished prefill's blocks: free them."""
        self.connector.revoke(request_id)
        return self.kv.release_lease(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        for request_id in self.kv.expire_leases(time.monotonic()):
            self.connector.revoke(request_id)
        out = SchedulerOutput()
        self._finish_loads(out)
        budget = self.config.max_num_batched_tokens
        drafts = propose_drafts(self.running, self.config.speculative, self.max_model_len)
        prefill_budget = self._prefill_budget(sum(map(len, drafts.values())))
        scheduled: set[str] = set()
        # decodes not yet scheduled: their tokens come before anyone's drafts
        decodes_left = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this loop
                continue
            left = request.num_tokens - request.num_computed_tokens
            decodes_left -= left == 1
            draft = drafts.get(request.request_id, [])[:max(budget - 1 - decodes_left, 0)]
            if draft and self.kv.allocate_slots(request, 1 + len(draft)) is not None:
                out.chunks.append(self._chunk(request, 1 + len(draft), draft))
                scheduled.add(request.request_id)
                budget -= 1 + len(draft)
                continue
            n = min(left, budget) if left <= 1 else min(left, budget, prefill_budget)
            if n <= 0:
                continue
            while self.kv.allocate_slots(request, n) is None:
                victim = self._pick_victim()
                if victim.request_id in scheduled:  # undo its chunk: its blocks are going
                    chunk = next(c for c in out.chunks if c.request is victim)
                    out.chunks.remove(chunk)
                    scheduled.discard(victim.request_id)
                    budget += chunk.num_tokens
                    prompt = chunk.num_tokens > 1 and not chunk.draft_token_ids
                    prefill_budget += chunk.num_tokens if prompt else 0
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.chunks.append(self._chunk(request, n))
                scheduled.add(request.request_id)
                budget -= n
                prefill_budget -= n if left > 1 else 0
        if not out.preempted:
            blocked = self._schedule_waiting(out, min(budget, prefill_budget))
            if blocked and not self.running and not self.loading:
                self._unblock(blocked)
        return out

    def _prefill_budget(self, num_drafts: int) -> int:
        """Prompt tokens this step may compute: while running requests are decoding (their
        next tokens wait for the whole step), max_prefill_tokens_with_decodes, or
        prefill_tokens_per_decode per decoding row (a request's token and its `num_drafts`
        drafts) when that is more."""
        cap, per_decode = (self.config.max_prefill_tokens_with_decodes,
                           self.config.prefill_tokens_per_decode)
        if cap is None or not self.config.enable_chunked_prefill:
            return self.config.max_num_batched_tokens
        decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running)
        if not decoding:
            return self.config.max_num_batched_tokens
        return max(cap, (per_decode or 0) * (decoding + num_drafts))

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> Request | None:
        """Start waiting requests in order while blocks and budget last; returns the request
        that found no room, if one did. Those that already hold blocks (their KV arrived) go
        first: the pool is theirs already, and only running them gives it back."""
        for request in self._waiting_in_order(holders_first=True):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return None
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            if request.grammar is not None and not self._grammar_ready(request, out):
                continue
            if self.kv.has_blocks(request.request_id):  # remote KV arrived, or a local fallback
                computed, num_cached = [], request.num_computed_tokens
            else:
                computed, num_cached = self.kv.get_computed_blocks(request)
            if request.remote_kv is not None:
                if not self._start_remote_load(request, computed, num_cached):
                    return request
                continue
            n = request.num_tokens - num_cached
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    return None
                n = budget
            if self.kv.allocate_slots(request, n, computed) is None:
                return request
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            out.chunks.append(self._chunk(request, n))
            budget -= n
        return None

    def _unblock(self, blocked: Request) -> None:
        """Nothing runs and `blocked` found no room: waiting requests whose KV arrived hold
        the pool and cannot grow either. The last of them in order lets its blocks go and will
        compute its prompt here instead, so the engine never stalls with requests queued."""
        holders = [r for r in self._waiting_in_order(holders_first=True)
                   if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS
                   and self.kv.has_blocks(r.request_id)
                   and (r.grammar is None or r.grammar.ready)]  # compiling: runs soon
        if not holders:
            return
        victim = holders[-1]
        logger.warning("request %s: its blocks go back to the pool (nothing else could run, "
                       "%s waits for room); it computes its prompt here", victim.request_id,
                       blocked.request_id)
        self.kv.free(victim)
        victim.num_computed_tokens = 0

    def _grammar_ready(self, request: Request, out: SchedulerOutput) -> bool:
        """A constrained request runs once its grammar is compiled (never waiting on a step)
        and its matcher has accepted the tokens it already has; else it fails."""
        if not request.grammar.ready:
            return False
        if request.grammar.activate(request.output_token_ids):
            return True
        request.error = request.grammar.error
        out.failed += self.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
        return False

    @property
    def compiling(self) -> list:
        """Grammars of waiting requests still compiling."""
        return [r.grammar for r in self.waiting if r.grammar is not None and not r.grammar.ready]

    def _waiting_in_order(self, holders_first: bool = False) -> list[Request]:
        if self.config.policy == "priority":
            order = sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        else:
            order = list(self.waiting)
        if holders_first:  # NOTE: a stable sort keeps the policy's order within each group
            order.sort(key=lambda r: not self.kv.has_blocks(r.request_id))
        return order

    # --- remote KV (decode side of disaggregation) ------------------------------------------

    def _start_remote_load(self, request: Request, computed: list[int], num_cached: int) -> bool:
        """Allocate the prompt's blocks and pull those not cached here; False if no room."""
        handle = request.remote_kv
        num_remote = handle.num_tokens
        if self.kv.allocate_slots(request, num_remote - num_cached, computed) is None:
            return False
        request.num_computed_tokens = num_cached
        request.num_cached_tokens = num_cached
        first, last = num_cached // self.block_size, cdiv(num_remote, self.block_size)
        local = self.kv.get_block_table(request.request_id)[first:last]
        request.remote_kv = None  # NOTE: one attempt; a failure falls back or fails below
        if not local:  # every block is cached here
            request.num_computed_tokens = num_remote
            self.connector.skip_load(handle)
            return True
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        request.pending_remote_tokens = num_remote
        self.connector.start_load(request.request_id, handle, list(handle.block_ids[first:last]),
                                  local)
        return True

    def _finish_loads(self, out: SchedulerOutput) -> None:
        for result in self.connector.take_finished_loads():
            self.load_results.append(result)
            self.kv_bytes_received += result.num_bytes
            self.kv_transfer_seconds += result.seconds
            self.kv_loads_failed += not result.ok
            request = self.loading.pop(result.request_id, None)
            if request is None:
                continue
            if request.is_finished:  # aborted while loading: its blocks can go now
                self._free(request)
                continue
            request.status = RequestStatus.WAITING
            if result.ok:
                request.num_computed_tokens = request.pending_remote_tokens
                continue
            logger.warning("KV load for %s failed: %s", request.request_id, result.error)
            if self.config.kv_failure_policy == "fail":
                request.error = f"KV transfer failed: {result.error}"
                out.failed += self.finish_requests([request.request_id],
                                                   RequestStatus.FINISHED_ERROR)
            # "recompute": the prompt beyond the local prefix is computed here instead.

    def _chunk(self, request: Request, n: int, drafts: list[int] | None = None) -> ScheduledChunk:
        return ScheduledChunk(request, request.num_computed_tokens, n,
                              self.kv.get_block_table(request.request_id), drafts or [])

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
        touched = list(sched.failed)
        for chunk in sched.chunks:
            request = chunk.request
            if request.is_finished:
                continue
            accepted = result.accepted.get(request.request_id, [])
            if chunk.draft_token_ids:  # the rejected drafts' keys and values are not kept
                request.drafts.record(len(chunk.draft_token_ids), len(accepted))
                self.num_drafts += 1
                self.num_draft_tokens += len(chunk.draft_token_ids)
                request.num_computed_tokens += 1 + len(accepted)
            else:
                request.num_computed_tokens += chunk.num_tokens
            sample = result.sampled.get(request.request_id)
            if sample is not None:
                for i, token in enumerate((*accepted, sample.token_id)):
                    request.append_output_token(token)
                    self.num_output_tokens += 1
                    self.num_accepted_tokens += i < len(accepted)
                    self._check_stop(request)
                    if request.is_finished:  # a kept draft ended it: nothing after counts
                        break
                extend_block_hashes(request.block_hashes, request.all_token_ids,
                                    self.block_size, request.hash_root)
                touched.append(request)
            elif request.request_id in result.pooled:  # an embedding is done: nothing follows
                request.status = RequestStatus.FINISHED_STOPPED
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
        if request.grammar is not None and request.grammar.error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = request.grammar.error
            return
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and (token == request.eos_token_id or token in self.eos_ids):
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return
        if request.grammar is not None and request.grammar.is_terminated:
            request.status = RequestStatus.FINISHED_STOPPED  # the constrained output is complete
            return
        max_tokens = params.max_tokens or self.max_model_len
        if request.num_output_tokens >= max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def _free(self, request: Request) -> None:
        if request.grammar is not None:
            request.grammar.release()
        params = request.kv_transfer_params or {}
        if (params.get("do_remote_decode")
                and request.status == RequestStatus.FINISHED_LENGTH_CAPPED):
            self._lease(request)
        else:
            self.kv.free(request)
        del self.requests[request.request_id]

    def _lease(self, request: Request) -> None:
        """Pin a finished prefill's blocks for the decode side and describe them."""
        lease_s = self.config.kv_lease_s
        num_tokens = request.num_computed_tokens
        blocks = self.kv.lease(request, time.monotonic() + lease_s)
        handle = self.connector.make_handle(
            request.request_id, blocks[:cdiv(num_tokens, self.block_size)],
            request.block_hashes[:num_tokens // self.block_size], num_tokens,
            time.time() + lease_s)
        if handle is None:  # nothing can read them: don't hold them
            self.kv.release_lease(request.request_id)
            return
        request.kv_transfer_params = {**request.kv_transfer_params, "handle": handle.to_dict()}
