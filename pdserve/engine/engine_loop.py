"""EngineLoop: runs one LLMEngine on its own thread so that servers can share it.

Callers on other threads `submit` requests and read their outputs from an `OutputStream`;
the loop steps the engine while there is work, and ticks while idle so that expired KV leases
are still freed. Callers' engine calls are queued and run by the loop between two steps, so a
new request waits at most one step: a lock taken by both sides would let the stepping thread,
which drops it only for an instant between steps, take it again step after step.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.cpu_turns import cpu_turn
from pdserve.engine.request_log import RequestLog
from pdserve.engine.stats_logger import Counters, StatsLogger
from pdserve.outputs import RequestOutput
from pdserve.pooling_params import PoolingParams
from pdserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # the loop is given an engine; importing one would load torch
    from pdserve.engine.llm_engine import LLMEngine


class StreamTimeout(TimeoutError):
    """No output arrived within the caller's deadline."""


class RequestAborted(RuntimeError):
    """The request was aborted before it finished: its stream's last item."""


class OutputStream:
    """The outputs of one request, in order; the last one has `finished` set."""

    def __init__(self, loop: EngineLoop, request_id: str):
        self.loop = loop
        self.request_id = request_id
        self._queue: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self._listener: Callable[[RequestOutput | BaseException], None] | None = None
        self._listen_lock = threading.Lock()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        with self._listen_lock:
            if self._listener is None:
                self._queue.put(item)
                return
        self._listener(item)

    def listen(self, callback: Callable[[RequestOutput | BaseException], None]) -> None:
        """Hand every output (or the engine's error) to `callback` instead of `get`: those
        queued already at once, later ones on the engine's thread, so `callback` must be quick
        and must not call the engine."""
        with self._listen_lock:
            while True:
                try:
                    callback(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._listener = callback

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Next output; raises StreamTimeout, or the engine's error if the loop died."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise StreamTimeout(f"request {self.request_id}: no output in {timeout:.1f}s")
        if isinstance(item, BaseException):
            raise item
        self.finished = item.finished
        return item

    def __iter__(self):
        while not self.finished:
            yield self.get()


@dataclass(frozen=True)
class EngineStats:
    waiting_requests: int
    running_requests: int
    waiting_tokens: int
    free_blocks: int
    total_blocks: int
    leased_requests: int
    prefix_queries: int
    prefix_hits: int
    kv_bytes_received: int
    kv_transfer_seconds: float
    kv_loads_failed: int
    cached_blocks: int
    prompt_tokens: int = 0  # computed so far (prefill), and sampled so far
    generation_tokens: int = 0
    speculative: bool = False  # drafts tokens (speculative_config); then:
    drafts: int = 0  # drafts verified, their tokens, and those kept
    draft_tokens: int = 0
    accepted_tokens: int = 0


class EngineLoop:
    """Owns the thread that steps an engine; thread-safe submit / abort / release."""

    def __init__(self, engine: LLMEngine, idle_tick_s: float = 0.05,
                 on_failure: Callable[[Exception], None] | None = None,
                 log_requests: bool = False, log_stats: bool = False):
        """`on_failure(error)` runs on the loop's thread if a step raises (the loop is dead
        then: every stream gets the error, later calls raise). Servers set `log_requests`
        (one INFO line per request's end, request_log.py) and `log_stats` (periodic stats,
        stats_logger.py; off with --disable-log-stats)."""
        self.engine = engine
        self.on_failure = on_failure
        self.request_log = RequestLog() if log_requests else None
        self.stats_logger = StatsLogger() if log_stats else None
        # Load as of the end of the last step, so that load reports and heartbeats never wait
        # for a step in progress (a long prefill must not look like a dead instance).
        self._latest_stats: EngineStats | None = None
        self.idle_tick_s = idle_tick_s
        self._lock = threading.Lock()  # held by whoever touches the engine
        self._calls: queue.SimpleQueue[tuple[Future, object, tuple]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, OutputStream] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        engine.connector.add_load_listener(self._wake.set)
        self._takes_cpu_turns = engine.config.device.device == "cpu"  # cpu_turns.py

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, request_id: str, prompt, params: SamplingParams | PoolingParams,
               kv_transfer_params: dict | None = None, priority: int = 0,
               output_kind: RequestOutputKind = RequestOutputKind.DELTA) -> OutputStream:
        """Queue a request; raises ValueError on bad input (nothing is queued then)."""
        params = params.clone()
        if isinstance(params, SamplingParams):  # PoolingParams: one final output
            params.output_kind = output_kind
        stream = OutputStream(self, request_id)
        start = time.monotonic()

        def add() -> None:
            if self._stopped.is_set():
                raise RuntimeError("engine loop is not running")
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self.engine.add_request(request_id, prompt, params, priority=priority,
                                    kv_transfer_params=kv_transfer_params)
            self._streams[request_id] = stream
            if self.request_log is not None:
                parent = self.engine.output_processor.parents[request_id]
                self.request_log.started(request_id, output_kind,
                                         len(parent.prompt_token_ids), start)

        self.call(add)
        return stream

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it was not running here."""
        return self.call(self._abort, request_id)

    def abort_soon(self, request_id: str) -> None:
        """`abort` without waiting for the step in progress: for threads that must not block
        (gRPC runs an RPC's done-callbacks on the thread that serves every call's events)."""
        self._queue(self._abort, (request_id,))

    def _abort(self, request_id: str) -> bool:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.engine.abort_request(request_id)
            stream.put(RequestAborted(f"request {request_id}: aborted"))  # ends any wait
            if self.request_log is not None:
                self.request_log.ended(request_id, "abort")
        return stream is not None

    def release_kv(self, request_id: str) -> bool:
        return self.call(self.engine.release_kv, request_id)

    def take_kv_events(self) -> list:
        """Prefix-cache events recorded since the last call (block_pool.KVEvent)."""
        return self.call(self.engine.block_pool.take_events)

    def kv_snapshot(self) -> list[int]:
        """Every block hash the prefix cache holds now (taking the pending events with it)."""
        def snapshot() -> list[int]:
            self.engine.block_pool.take_events()
            return list(self.engine.block_pool.cached)

        return self.call(snapshot)

    def stats(self) -> EngineStats:
        """The engine's load as of the end of its last step, without waiting for the one in
        progress (before the first step, or once the loop is stopped: taken now)."""
        latest = self._latest_stats
        if latest is None or self._stopped.is_set():
            return self.call(self._stats)
        return latest

    def call(self, fn, *args):
        """Run `fn(*args)` on the engine between two steps; its result, or its exception."""
        return self._queue(fn, args).result()

    def _queue(self, fn, args: tuple) -> Future:
        """Queue `fn(*args)` for the engine's thread; its future."""
        future: Future = Future()
        self._calls.put((future, fn, args))
        self._wake.set()
        if self._stopped.is_set() or not self._thread.is_alive():
            self._run_calls()  # nothing steps (any more): run it on this thread
        return future

    def _run_calls(self) -> None:
        with self._lock:
            while True:
                try:
                    future, fn, args = self._calls.get_nowait()
                except queue.Empty:
                    return
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)

    def _stats(self) -> EngineStats:
        sched = self.engine.scheduler
        pool = self.engine.block_pool
        return EngineStats(
            waiting_requests=sched.num_waiting, running_requests=sched.num_running,
            waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
            free_blocks=pool.num_free_blocks, total_blocks=pool.num_blocks,
            leased_requests=len(self.engine.kv_manager.leases),
            prefix_queries=pool.num_queries, prefix_hits=pool.num_hits,
            kv_bytes_received=sched.kv_bytes_received,
            kv_transfer_seconds=sched.kv_transfer_seconds,
            kv_loads_failed=sched.kv_loads_failed, cached_blocks=len(pool.cached),
            prompt_tokens=self.engine.num_prompt_tokens,
            generation_tokens=self.engine.num_generation_tokens,
            speculative=self.engine.config.scheduler.speculative is not None,
            drafts=sched.num_drafts, draft_tokens=sched.num_draft_tokens,
            accepted_tokens=sched.num_accepted_tokens)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._run_calls()
                with self._lock:
                    busy = self.engine.has_unfinished_requests()
                    tokens_before = self._tokens_computed()
                with self._cpu_turn(busy), self._lock:
                    outputs = self.engine.step()
                    # Nothing computed, and remote KV loads in flight: sleep until one
                    # finishes (the connector wakes the loop) instead of spinning empty steps.
                    only_loading = (not outputs and bool(self.engine.scheduler.loading)
                                    and self._tokens_computed() == tokens_before)
                    streams = [(self._streams.get(o.request_id), o) for o in outputs]
                    for _, o in streams:
                        if o.finished:
                            self._streams.pop(o.request_id, None)
                    self._latest_stats = self._stats()
            except Exception as e:  # noqa: BLE001 - a dead loop must not hang its callers
                self._fail_all(e)
                return
            for stream, output in streams:
                if stream is not None:
                    stream.put(output)
            self._log(outputs, self._latest_stats)
            if not busy or only_loading:
                self._wake.wait(self.idle_tick_s)
                self._wake.clear()
        self._run_calls()  # those queued while it stopped

    def _tokens_computed(self) -> int:
        return self.engine.num_prompt_tokens + self.engine.num_generation_tokens

    def _cpu_turn(self, busy: bool) -> contextlib.AbstractContextManager:
        """A CPU engine's step with work to do holds its process's turn (cpu_turns.py): the
        whole step, since its Python work would otherwise preempt the other's compute."""
        if busy and self._takes_cpu_turns:
            return cpu_turn()
        return contextlib.nullcontext()

    def _log(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        if self.request_log is not None:
            for output in outputs:
                self.request_log.output(output)
        if self.stats_logger is not None:
            self.stats_logger.observe(
                Counters(stats.prompt_tokens, stats.generation_tokens, stats.prefix_queries,
                         stats.prefix_hits, stats.draft_tokens, stats.accepted_tokens),
                stats.running_requests, stats.waiting_requests,
                stats.total_blocks - stats.free_blocks, stats.total_blocks)

    def _fail_all(self, error: Exception) -> None:
        self._stopped.set()
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            if self.request_log is not None:
                self.request_log.ended(stream.request_id, "error", f"engine failed: {error}")
            stream.put(RuntimeError(f"engine failed: {error}"))
        self._run_calls()
        if self.on_failure is not None:
            self.on_failure(error)
