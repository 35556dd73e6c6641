"""One INFO line per served request when it ends (logger `pdserve.request`): its id, finish
status, prompt and output token counts, time to first token and end-to-end seconds (from the
engine's own record of the request's times, `RequestOutput.metrics`).

`EngineLoop` feeds it on its own thread (no lock): `started` when a request is queued,
`output` for each output it hands out, `ended` when it is aborted or the engine fails. With
`--log-format json` the numbers are also fields of the record (logging_setup.JsonFormatter).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.outputs import RequestMetrics, RequestOutput
from pdserve.sampling_params import RequestOutputKind

logger = logging.getLogger("pdserve.request")


@dataclass
class _Progress:
    start: float
    delta: bool  # outputs carry new tokens only (else all tokens so far)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: dict[int, int] = field(default_factory=dict)  # per completion index
    reasons: dict[int, str] = field(default_factory=dict)
    metrics: RequestMetrics | None = None  # the engine's times, as of its latest output


class RequestLog:
    """Tracks requests from submit to end and logs each one's end."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._open: dict[str, _Progress] = {}

    def started(self, request_id: str, output_kind: RequestOutputKind, prompt_tokens: int,
                start: float | None = None) -> None:
        """`start`: when the caller submitted it (default: now; the end-to-end time of a
        request that ends before the engine reports its times)."""
        self._open[request_id] = _Progress(self.clock() if start is None else start,
                                           output_kind == RequestOutputKind.DELTA,
                                           prompt_tokens)

    def output(self, out: RequestOutput) -> None:
        """Count an output's tokens; log the request if it is the last one."""
        p = self._open.get(out.request_id)
        if p is None:
            return
        p.prompt_tokens = len(out.prompt_token_ids or ())
        p.cached_tokens = out.num_cached_tokens or 0
        p.metrics = out.metrics or p.metrics
        for c in out.outputs if isinstance(out.outputs, list) else ():  # pooling: none
            n = len(c.token_ids)
            p.output_tokens[c.index] = p.output_tokens.get(c.index, 0) + n if p.delta else n
            if c.finish_reason:
                p.reasons[c.index] = c.finish_reason
        if out.finished:
            status = "error" if out.error else ",".join(dict.fromkeys(p.reasons.values()))
            self._log(out.request_id, status or "stop", out.error)

    def ended(self, request_id: str, status: str, error: str | None = None) -> None:
        """The request ended without a final output: "abort" (the client left) or "error"."""
        if request_id in self._open:
            self._log(request_id, status, error)

    def _log(self, request_id: str, status: str, error: str | None) -> None:
        p = self._open.pop(request_id)
        m = p.metrics
        ttft = (None if m is None or m.first_token_time is None
                else m.first_token_time - m.arrival_time)
        e2e = (self.clock() - p.start if m is None or m.finished_time is None
               else m.finished_time - m.arrival_time)
        output_tokens = sum(p.output_tokens.values())
        fields = {"request_id": request_id, "finish_reason": status,
                  "prompt_tokens": p.prompt_tokens, "output_tokens": output_tokens,
                  "cached_tokens": p.cached_tokens,
                  "ttft_s": None if ttft is None else round(ttft, 4), "e2e_s": round(e2e, 4)}
        if error:
            fields["error"] = error
        ttft_text = "-" if ttft is None else f"{ttft:.3f} s"
        logger.info("request %s finished (%s): %d prompt tokens (%d cached), %d output "
                    "tokens, TTFT %s, %.3f s end to end%s", request_id, status,
                    p.prompt_tokens, p.cached_tokens, output_tokens, ttft_text, e2e,
                    f": {error}" if error else "", extra={"fields": fields})
