"""One HTTP request's generation: its backend requests (one per prompt) started together,
their deltas merged in arrival order, timing metrics and usage recorded on the way."""

from __future__ import annotations

import asyncio
import time

from pdserve.gateway.backend import Backend, Delta, DeltaStream, Usage
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.sampling_params import SamplingParams


class _Timing:
    """Latency bookkeeping of one backend request."""

    def __init__(self, arrival: float):
        self.arrival = arrival
        self.first: float | None = None
        self.last_by_index: dict[int, float] = {}


class Generation:
    """Iterate to get (choice index, Delta); choice index = prompt index * n + delta.index."""

    def __init__(self, streams: list[DeltaStream], n: int, metrics: GatewayMetrics,
                 arrival: float):
        self.streams = streams
        self.n = n
        self.metrics = metrics
        self.usage = Usage()
        self._timing = [_Timing(arrival) for _ in streams]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._drain(i, s)) for i, s in enumerate(streams)]
        self._open = len(streams)

    @classmethod
    async def start(cls, backend: Backend, request_id: str,
                    requests: list[tuple[str | list[int], SamplingParams]],
                    metrics: GatewayMetrics, priority: int = 0,
                    cache_salt: str | None = None) -> Generation:
        """Start one backend request per (prompt, params); on an error abort those started."""
        arrival = time.monotonic()
        streams: list[DeltaStream] = []
        try:
            for i, (prompt, params) in enumerate(requests):
                rid = request_id if len(requests) == 1 else f"{request_id}-{i}"
                streams.append(await backend.generate(rid, prompt, params, priority, cache_salt))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        return cls(streams, requests[0][1].n, metrics, arrival)

    async def _drain(self, i: int, stream: DeltaStream) -> None:
        try:
            async for delta in stream:
                self._record(i, delta)
                await self._queue.put((i * self.n + delta.index, delta))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await self._queue.put(e)
        finally:
            await self._queue.put(None)

    def _record(self, i: int, d: Delta) -> None:
        now, t, m = time.monotonic(), self._timing[i], self.metrics
        if d.token_ids:
            m.generation_tokens.inc(len(d.token_ids))
            if t.first is None:
                t.first = now
                m.ttft.observe(now - t.arrival)
            elif d.index in t.last_by_index:
                m.itl.observe(now - t.last_by_index[d.index])
            t.last_by_index[d.index] = now
        if d.finish_reason:
            m.finished(d.finish_reason)
        if d.served_by is not None and d.usage is not None:
            m.routed(d.served_by)
        if d.usage is not None:
            self.usage = self.usage + d.usage
            m.prompt_tokens.inc(d.usage.prompt_tokens)
            m.e2e.observe(now - t.arrival)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        while self._open:
            item = await self._queue.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Abort whatever has not finished (idempotent)."""
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            await stream.aclose()
