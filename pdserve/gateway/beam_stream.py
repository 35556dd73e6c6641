"""Beam search behind the HTTP API (`use_beam_search`), over any backend: each step asks the
backend for one token of every live beam, with its top 2 x beam_width logprobs, as ordinary
requests (a local engine or a cluster's router alike; the prefix cache keeps the shared
tokens). The stream yields the best beams, one Delta each (index = rank), when the search ends.
"""

from __future__ import annotations

import itertools
import time

from pdserve.beam_search import BeamSearch, BeamSearchParams
from pdserve.gateway.backend import Backend, Delta, DeltaStream, Usage
from pdserve.gateway.generation import Generation
from pdserve.gateway.serving import gather_or_cancel
from pdserve.sampling_params import SamplingParams


class BeamSearchStream(DeltaStream):
    """The DeltaStream of one prompt's beam search."""

    def __init__(self, backend: Backend, request_id: str, prompt_ids: list[int],
                 params: BeamSearchParams, eos_token_id: int | None, decode, priority: int = 0,
                 cache_salt: str | None = None):
        self.backend, self.request_id, self.priority = backend, request_id, priority
        self.cache_salt = cache_salt
        self.search = BeamSearch(prompt_ids, params, eos_token_id)
        self.decode = decode
        self.step = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                                   temperature=params.temperature, ignore_eos=True)
        self._ids = itertools.count()
        self._deltas: list[Delta] | None = None
        self._open: list[DeltaStream] = []

    async def _candidates(self, tokens: list[int]) -> dict[int, float]:
        stream = await self.backend.generate(f"{self.request_id}-beam{next(self._ids)}",
                                             tokens, self.step, self.priority,
                                             self.cache_salt)
        self._open.append(stream)
        try:
            candidates: dict[int, float] = {}
            async for delta in stream:
                for position in delta.logprobs or []:
                    candidates.update({e.token_id: e.logprob for e in position or []})
            return candidates
        finally:
            self._open.remove(stream)
            await stream.aclose()

    async def _run(self) -> list[Delta]:
        while batch := self.search.next_batch():
            self.search.advance(await gather_or_cancel(*map(self._candidates, batch)))
        beams = self.search.result(self.decode).sequences
        prompt_len = self.search.prompt_len
        deltas = [Delta(i, beam.tokens[prompt_len:], beam.text or "",
                        finish_reason=beam.finish_reason) for i, beam in enumerate(beams)]
        generated = sum(len(d.token_ids) for d in deltas)
        deltas[-1].usage = Usage(prompt_len, generated)
        return deltas

    async def __anext__(self) -> Delta:
        if self._deltas is None:
            self._deltas = await self._run()
        if not self._deltas:
            raise StopAsyncIteration
        return self._deltas.pop(0)

    async def aclose(self) -> None:
        for stream in list(self._open):
            await stream.aclose()


def beam_generation(ctx, request_id: str, requests: list[tuple[list[int], BeamSearchParams]],
                    priority: int = 0, cache_salt: str | None = None) -> Generation:
    """A Generation whose choices are each prompt's best beams (beam_width per prompt)."""
    streams = [BeamSearchStream(ctx.backend, f"{request_id}-{i}", ids, params,
                                ctx.tokenizer.eos_token_id, ctx.decode, priority, cache_salt)
               for i, (ids, params) in enumerate(requests)]
    return Generation(streams, requests[0][1].beam_width, ctx.metrics, time.monotonic())
