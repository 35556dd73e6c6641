"""LocalBackend: one colocated engine in this process (`pdserve serve`).

The engine steps on its EngineLoop thread. Engine calls (submit, abort, stats) wait for the
step in flight, so they run on a small thread pool rather than on the event loop. Each
request's OutputStream hands its outputs straight from the engine's thread to the event loop
(`call_soon_threadsafe`); closing the stream aborts the request.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.engine_loop import EngineLoop, OutputStream
from pdserve.engine.llm_engine import LLMEngine
from pdserve.gateway.backend import (
    Backend,
    BackendError,
    BackendStats,
    BackendUnavailable,
    Delta,
    DeltaStream,
    ModelInfo,
    TokenLogprob,
    Usage,
)
from pdserve.outputs import Logprob, PoolingRequestOutput, RequestOutput
from pdserve.pooling_params import PoolingParams
from pdserve.sampling_params import SamplingParams
from pdserve.structured_outputs import is_constraint_error


class LocalBackend(Backend):
    supports_prompt_logprobs = True

    def __init__(self, engine: LLMEngine, model: str | None = None,
                 log_requests: bool = False, log_stats: bool = False):
        """`log_requests`, `log_stats`: the engine loop's request-end and periodic stats
        lines (EngineLoop)."""
        self.engine = engine
        self.model = model or engine.config.model.model
        self.loop = EngineLoop(engine, log_requests=log_requests, log_stats=log_stats).start()
        self._calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-call")

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LocalBackend:
        """An engine built from `engine_args`, served as its served_model_name (or model),
        logging each request's end and, unless disable_log_stats, periodic stats."""
        engine = LLMEngine.from_engine_args(engine_args)
        return cls(engine, engine.config.model.served_name, log_requests=True,
                   log_stats=not engine_args.disable_log_stats)

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._calls, fn, *args)

    async def _submit(self, request_id: str, prompt, params, **kwargs):
        """Submit to the engine loop. A caller that leaves while the submit is queued behind
        a step has the request aborted once it lands; a stopped loop (the engine failed) is
        BackendUnavailable, a 503."""
        submit = functools.partial(self.loop.submit, request_id, prompt, params, **kwargs)
        submitted = asyncio.get_running_loop().run_in_executor(self._calls, submit)
        try:
            return await asyncio.shield(submitted)
        except asyncio.CancelledError:
            submitted.add_done_callback(
                lambda f: f.cancelled() or f.exception() or self._abort_soon(request_id))
            raise
        except RuntimeError as e:
            raise BackendUnavailable(f"the engine is not serving: {e}") from e

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams, priority: int = 0,
                       cache_salt: str | None = None) -> DeltaStream:
        engine_prompt: dict = ({"prompt": prompt} if isinstance(prompt, str)
                               else {"prompt_token_ids": list(prompt)})
        if cache_salt is not None:
            engine_prompt["cache_salt"] = cache_salt
        stream = await self._submit(request_id, engine_prompt, params, priority=priority)
        return _LocalStream(self, stream)

    async def embed(self, request_id: str, prompt_ids: list[int],
                    pooling: PoolingParams) -> list[float]:
        """Submitted to the engine loop as a pooling request; its one (final) output is
        handed from the engine's thread to this event loop."""
        aloop = asyncio.get_running_loop()
        stream = await self._submit(request_id, {"prompt_token_ids": list(prompt_ids)},
                                    pooling)
        done: asyncio.Future[PoolingRequestOutput | BaseException] = aloop.create_future()

        def deliver(item) -> None:  # on the engine's thread
            def settle() -> None:
                if not done.done():
                    done.set_result(item)
            try:
                aloop.call_soon_threadsafe(settle)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        stream.listen(deliver)
        try:
            out = await done
        except asyncio.CancelledError:  # the client left: free its blocks
            self._abort_soon(request_id)
            raise
        if isinstance(out, BaseException):
            raise BackendError(str(out))
        if out.error:
            raise BackendError(f"request {request_id} failed: {out.error}")
        return out.outputs.data.tolist()

    def _abort_soon(self, request_id: str) -> None:
        try:
            self._calls.submit(self.loop.abort, request_id)
        except RuntimeError:  # closed: the loop is stopped, nothing runs any more
            pass

    async def abort(self, request_id: str) -> None:
        await self._call(self.loop.abort, request_id)

    async def health(self) -> bool:
        # NOTE: EngineLoop has no public liveness flag; its thread ends only when the engine
        # failed or the loop was stopped.
        return self.loop._thread.is_alive()

    def models(self) -> list[ModelInfo]:
        cfg = self.engine.config.model
        return [ModelInfo(self.model, cfg.resolved.path, cfg.max_model_len, cfg.max_logprobs,
                          cfg.sampling_defaults, cfg.max_tokens_cap)]

    def load_tokenizer(self):
        """The engine's tokenizer (its path, mode and chat template), as a second instance:
        the engine's own is used on the engine's thread."""
        from pdserve.models.loader import load_tokenizer

        tok = self.engine.config.model.tokenizer_config
        return load_tokenizer(tok.source, tok.mode, tok.chat_template)

    async def stats(self) -> BackendStats:
        s = await self._call(self.loop.stats)
        drafts = s.speculative
        return BackendStats(
            running_requests=s.running_requests, waiting_requests=s.waiting_requests,
            free_blocks=s.free_blocks, total_blocks=s.total_blocks,
            prefix_queries=s.prefix_queries, prefix_hits=s.prefix_hits,
            kv_transfer_bytes=getattr(s, "kv_bytes_received", None),
            kv_transfer_seconds=getattr(s, "kv_transfer_seconds", None),
            spec_drafts=s.drafts if drafts else None,
            spec_draft_tokens=s.draft_tokens if drafts else None,
            spec_accepted_tokens=s.accepted_tokens if drafts else None,
            instances={"colocated": 1})

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.loop.stop)
        self._calls.shutdown(wait=False, cancel_futures=True)


class _LocalStream(DeltaStream):
    def __init__(self, backend: LocalBackend, stream: OutputStream):
        self._backend = backend
        self._stream = stream
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._pending: deque[Delta] = deque()
        self._finished = False
        self._first = True
        self._completion_tokens = 0
        aloop = asyncio.get_running_loop()

        def deliver(item: RequestOutput | BaseException) -> None:  # on the engine's thread
            try:
                aloop.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        stream.listen(deliver)

    async def __anext__(self) -> Delta:
        while not self._pending:
            if self._finished:
                raise StopAsyncIteration
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._finished = True
                raise BackendError(str(item))
            if item.error:
                self._finished = True
                if is_constraint_error(item.error):  # the request's constraint: a 400
                    raise ValueError(item.error)
                raise BackendError(f"request {item.request_id} failed: {item.error}")
            self._pending.extend(self._deltas(item))
            self._finished = item.finished
        return self._pending.popleft()

    def _deltas(self, out: RequestOutput) -> list[Delta]:
        deltas = []
        for c in out.outputs:
            self._completion_tokens += len(c.token_ids)
            logprobs = None
            if c.logprobs is not None:
                logprobs = [_position(e, t) for e, t in zip(c.logprobs, c.token_ids)]
            deltas.append(Delta(c.index, list(c.token_ids), c.text, logprobs, c.finish_reason,
                                c.stop_reason))
        if not deltas:
            deltas.append(Delta(0, [], ""))
        if self._first:
            prompt = list(out.prompt_token_ids or [])
            deltas[0].prompt_token_ids = prompt
            if out.prompt_logprobs is not None:
                deltas[0].prompt_logprobs = [_position(e, t)
                                             for e, t in zip(out.prompt_logprobs, prompt)]
            self._first = False
        if out.finished:
            deltas[-1].usage = Usage(len(out.prompt_token_ids or []), self._completion_tokens,
                                     out.num_cached_tokens or 0)
        return deltas

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._backend._abort_soon(self._stream.request_id)


def _position(entry: dict[int, Logprob] | None, sampled: int) -> list[TokenLogprob] | None:
    if not entry:
        return None
    order = [sampled] + [t for t in entry if t != sampled]
    return [TokenLogprob(t, entry[t].logprob, entry[t].rank, entry[t].decoded_token or "")
            for t in order if t in entry]
