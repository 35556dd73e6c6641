"""One INFO line per `Router.Generate` call when it ends (logger `pdserve.request.router`), as
the engine logs its requests (pdserve/engine/request_log.py): the request id, how it ended,
prompt / cached / output token counts, time to first token and end-to-end seconds as the
router saw them, and which instances served it (prefill, decode, migrations). No prompt text.

How it ended: the completions' finish reasons ("length", "stop", or "stop,length" for n > 1),
"abort" when the client went away, "error" when the router ended the call with a status (the
record's `error` says which and why). With `--log-format json` the numbers are also fields of
the record (logging_setup.JsonFormatter). The logger is a child of the engine's
`pdserve.request`, so one logging setting silences both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.proto.pdserve.v1 import common_pb2

logger = logging.getLogger("pdserve.request.router")


class RouterRequestLog:
    """What one Generate call sent the client, logged once when the call ends."""

    def __init__(self, request_id: str, clock: Callable[[], float] = time.monotonic):
        self.request_id = request_id
        self.clock = clock
        self.start = clock()
        self.first_token: float | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.reasons: dict[int, str] = {}
        self.done = False

    def sent(self, msg: common_pb2.GenerateResponse) -> None:
        """Count a message handed to the client."""
        if msg.token_ids and self.first_token is None:
            self.first_token = self.clock()
        self.output_tokens += len(msg.token_ids)
        if msg.finish_reason:
            self.reasons[msg.index] = msg.finish_reason
        if msg.HasField("usage") and msg.usage.cached_tokens:
            self.cached_tokens = msg.usage.cached_tokens

    def ended(self, served: common_pb2.ServedBy, status: str | None = None,
              error: str | None = None) -> None:
        """Log the request's end (once). `status`: None for the finish reasons of the
        completions the client received; else "abort" or "error"."""
        if self.done:
            return
        self.done = True
        status = status or ",".join(dict.fromkeys(self.reasons.values())) or "stop"
        end = self.clock()
        ttft = None if self.first_token is None else self.first_token - self.start
        e2e = end - self.start
        fields = {"request_id": self.request_id, "finish_reason": status,
                  "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                  "cached_tokens": self.cached_tokens,
                  "ttft_s": None if ttft is None else round(ttft, 4), "e2e_s": round(e2e, 4),
                  "prefill_instance": served.prefill_instance or None,
                  "decode_instance": served.decode_instance or None,
                  "disaggregated": served.disaggregated,
                  "prefill_attempts": served.prefill_attempts,
                  "migrations": served.migrations}
        if error:
            fields["error"] = error
        where = (f"prefill {served.prefill_instance or '-'}, "
                 f"decode {served.decode_instance or '-'}")
        if served.migrations:
            where += f", {served.migrations} migrations"
        ttft_text = "-" if ttft is None else f"{ttft:.3f} s"
        logger.info("request %s finished (%s): %d prompt tokens (%d cached), %d output tokens, "
                    "TTFT %s, %.3f s end to end; %s%s", self.request_id, status,
                    self.prompt_tokens, self.cached_tokens, self.output_tokens, ttft_text, e2e,
                    where, f": {error}" if error else "", extra={"fields": fields})
