"""Turns engine progress into RequestOutputs: detokenizes, finds stop strings, gathers
logprobs, and merges the n child sequences of a request into one output."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.step_records import ModelRunnerOutput
from pdserve.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pdserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SequenceState:
    """Output-side state of one child sequence."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    sent_tokens: int = 0
    num_tokens_seen: int = 0  # output tokens given to the detokenizer
    finish_sent: bool = False


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    pooled: object = None  # a pooling request's result (a tensor), once computed

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


class OutputProcessor:
    """Keeps per-request output state; `process` is called once per engine step."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, SequenceState]] = {}
        # Tokens dropped after a stop string completed inside kept drafts (_detokenize).
        self.num_dropped_tokens = 0

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        params = children[0].sampling_params if len(children) == 1 else None
        parent = ParentState(request_id, prompt, children[0].prompt_token_ids,
                             params or children[0].sampling_params)
        if parent.params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for i, child in enumerate(children):
            p = child.sampling_params
            state = SequenceState(
                i, child, IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, p),
                [] if p.logprobs is not None else None,
                0.0 if p.logprobs is not None else None)
            if child.output_token_ids:  # sampled by a remote prefill: text and no logprobs
                state.detokenizer.update(list(child.output_token_ids), 0)
                state.num_tokens_seen = child.num_output_tokens
                if state.logprobs is not None:
                    state.logprobs.extend([None] * child.num_output_tokens)
            parent.sequences.append(state)
            self.child_to_parent[child.request_id] = (parent, state)
        self.parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [s.request.request_id for s in parent.sequences] if parent else []

    def process(self, touched: list[Request], result: ModelRunnerOutput) -> list[Request]:
        """Detokenize new tokens; returns the requests a stop string just ended (the caller
        finishes them in the scheduler)."""
        stopped: list[Request] = []
        now = time.time()
        for request in touched:
            parent, seq = self.child_to_parent[request.request_id]
            metrics = parent.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            self._add_prompt_logprobs(parent, result.prompt_logprobs.get(request.request_id))
            if request.request_id in result.pooled:
                parent.pooled = result.pooled[request.request_id]
                metrics.first_token_time = metrics.last_token_time = now
                continue
            sample = result.sampled.get(request.request_id)
            if sample is None:
                continue
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            stop = self._detokenize(seq, request)
            if stop is not None and not request.is_finished:
                request.stop_reason = stop
                stopped.append(request)
            elif stop is not None and request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
                # the last token allowed completed a stop string: a stop, as in vLLM (the
                # request's blocks are already freed)
                request.stop_reason = stop
                request.status = RequestStatus.FINISHED_STOPPED
            if seq.logprobs is not None and sample.logprobs is not None:
                kept = result.accepted.get(request.request_id, [])
                self._add_logprobs(seq, request, [*kept, sample.token_id],
                                   [*(sample.draft_logprobs or ()), sample.logprobs])
        return stopped

    def _add_logprobs(self, seq: SequenceState, request: Request, tokens: list[int],
                      entries: list[dict[int, tuple[float, int]]]) -> None:
        """The logprobs of the step's tokens (kept drafts, then the sampled one; `entries` one
        for each) that stay in the output, up to where a stop token or stop string ended it."""
        stays = request.num_output_tokens - len(seq.logprobs)
        for token, raw in list(zip(tokens, entries))[:stays]:
            seq.logprobs.append(self._logprob_dict(raw, request.sampling_params))
            seq.cumulative_logprob += raw[token][0]

    def _detokenize(self, seq: SequenceState, request: Request) -> str | None:
        """Give the detokenizer the request's new output tokens (kept drafts, then the sampled
        one: ngram_drafts.py), one at a time; returns the stop string found. A stop string
        ends the output at the token that completes it: the tokens after it are dropped, as
        decoding one token a step would never have made them. A stop token or EOS that ended
        the request adds no text (as in vLLM)."""
        seen, total = seq.num_tokens_seen, request.num_output_tokens
        ended_by_token = request.status == RequestStatus.FINISHED_STOPPED
        seq.num_tokens_seen = total
        for n in range(seen + 1, total + 1):
            stop = seq.detokenizer.update([request.output_token_ids[n - 1]], n,
                                          stop_terminated=ended_by_token and n == total)
            if stop is not None and n < total:
                del request.output_token_ids[n:]
                self.num_dropped_tokens += total - n
                seq.num_tokens_seen = n
                if request.is_finished:  # by a later token: the stop string came first
                    request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            if stop is not None:
                return stop
        return None

    def make_outputs(self, touched: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per parent request that progressed (as its output_kind allows)."""
        parents = {}
        for request in touched:
            if request.request_id in self.child_to_parent:
                parent = self.child_to_parent[request.request_id][0]
                parents[parent.request_id] = parent
        outputs = [o for p in parents.values() if (o := self._make_output(p)) is not None]
        for p in parents.values():
            if p.finished:
                self.remove(p.request_id)
        return outputs

    def remove(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent:
            for s in parent.sequences:
                self.child_to_parent.pop(s.request.request_id, None)

    def _add_prompt_logprobs(self, parent: ParentState, chunk) -> None:
        """Append a chunk's positions not yet reported, in order. A chunk recomputed after
        preemption repeats earlier ones; of n > 1 siblings (each computes the whole prompt:
        no prefix cache hits with prompt_logprobs), one ahead of the others waits for them."""
        if chunk is None or parent.prompt_logprobs is None:
            return
        start, positions = chunk  # positions[i] is that of prompt token start + 1 + i
        reported = len(parent.prompt_logprobs)  # tokens 0 .. reported - 1
        room = len(parent.prompt_token_ids) - reported
        first = reported - 1 - start
        if first < 0:
            return  # a sibling ahead: the one behind reports these positions when it gets there
        parent.prompt_logprobs.extend(self._logprob_dict(d, parent.params)
                                      for d in positions[first:first + room])

    def _logprob_dict(self, raw: dict[int, tuple[float, int]],
                      params: SamplingParams) -> dict[int, Logprob]:
        """Logprobs of one position; `decoded_token` stays None with detokenize=False."""
        decode = self.tokenizer is not None and params.detokenize
        return {tid: Logprob(lp, rank, self.tokenizer.decode([tid]) if decode else None)
                for tid, (lp, rank) in raw.items()}

    def _make_output(self, parent: ParentState) -> RequestOutput | PoolingRequestOutput | None:
        kind = parent.params.output_kind
        finished = parent.finished
        if parent.sequences[0].request.pooling_params is not None:
            return self._make_pooling_output(parent) if finished else None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = []
        for seq in parent.sequences:
            request = seq.request
            done = request.is_finished
            if delta and seq.finish_sent:  # DELTA: a finished sequence is reported once
                continue
            seq.finish_sent = done
            start = seq.sent_tokens if delta else 0
            text = seq.detokenizer.get_next_output_text(done, delta)
            logprobs = seq.logprobs[start:] if seq.logprobs is not None else None
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=request.output_token_ids[start:],
                cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs,
                finish_reason=request.status.finish_reason if done else None,
                stop_reason=request.stop_reason if done else None))
            seq.sent_tokens = request.num_output_tokens
        first = parent.sequences[0].request
        if finished and parent.metrics.finished_time is None:
            parent.metrics.finished_time = time.time()
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, prompt_logprobs=parent.prompt_logprobs,
            outputs=completions, finished=finished, metrics=copy.copy(parent.metrics),
            num_cached_tokens=max(first.num_cached_tokens, 0),
            kv_transfer_params=first.kv_transfer_params if finished else None,
            error=first.error)

    def _make_pooling_output(self, parent: ParentState) -> PoolingRequestOutput:
        request = parent.sequences[0].request
        if parent.metrics.finished_time is None:
            parent.metrics.finished_time = time.time()
        return PoolingRequestOutput(
            request_id=parent.request_id, outputs=PoolingOutput(parent.pooled),
            prompt_token_ids=parent.prompt_token_ids, finished=True,
            num_cached_tokens=max(request.num_cached_tokens, 0), prompt=parent.prompt,
            metrics=copy.copy(parent.metrics), error=request.error)
