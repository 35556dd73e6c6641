"""Periodic engine stats, as vLLM logs them: every 10 s while there is traffic, one INFO line
(logger `pdserve.stats`) with the prompt and generation throughput over the interval, running
and waiting requests, KV cache usage and prefix cache hit rate. One more line follows the
traffic's end (it shows the engine idle); an idle engine logs nothing.

Servers turn it off with --disable-log-stats. PDSERVE_LOG_STATS_INTERVAL_S changes the
interval (meant for tests).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("pdserve.stats")

INTERVAL_ENV = "PDSERVE_LOG_STATS_INTERVAL_S"
DEFAULT_INTERVAL_S = 10.0


def interval_from_env() -> float:
    """The interval: $PDSERVE_LOG_STATS_INTERVAL_S if set, else 10 s."""
    text = os.environ.get(INTERVAL_ENV, "")
    try:
        value = float(text) if text else DEFAULT_INTERVAL_S
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV}: expected seconds, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"{INTERVAL_ENV}: must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class Counters:
    """Running totals an engine keeps, read once per interval."""

    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    draft_tokens: int = 0  # speculative decoding: tokens drafted, and those the model kept
    accepted_tokens: int = 0


class StatsLogger:
    """Call `observe` often (every loop iteration); it logs at most once per interval."""

    def __init__(self, interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_from_env() if interval_s is None else interval_s
        self.clock = clock
        self._since = clock()
        self._last: Counters | None = None
        self._was_active = False

    def observe(self, counters: Counters, running: int, waiting: int, used_blocks: int,
                total_blocks: int) -> bool:
        """Log a line if an interval has passed and there was traffic in it (or in the
        interval before); True if it logged."""
        now = self.clock()
        if self._last is None:
            self._last, self._since = counters, now
            return False
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return False
        prompt = counters.prompt_tokens - self._last.prompt_tokens
        generation = counters.generation_tokens - self._last.generation_tokens
        queries = counters.prefix_queries - self._last.prefix_queries
        hits = counters.prefix_hits - self._last.prefix_hits
        active = bool(prompt or generation or running or waiting)
        last, self._last, self._since = self._last, counters, now
        if not (active or self._was_active):
            return False
        self._was_active = active
        usage = 100.0 * used_blocks / total_blocks if total_blocks else 0.0
        hit_rate = 100.0 * hits / queries if queries else 0.0
        fields = {"prompt_tokens_per_s": round(prompt / elapsed, 2),
                  "generation_tokens_per_s": round(generation / elapsed, 2),
                  "running_requests": running, "waiting_requests": waiting,
                  "kv_cache_usage_pct": round(usage, 2),
                  "prefix_cache_hit_rate_pct": round(hit_rate, 2)}
        drafted = counters.draft_tokens - last.draft_tokens
        accepted = counters.accepted_tokens - last.accepted_tokens
        draft_note = ""
        if drafted:  # as vLLM's speculative decoding line
            fields |= {"draft_tokens": drafted, "accepted_tokens": accepted,
                       "draft_acceptance_rate_pct": round(100.0 * accepted / drafted, 2)}
            draft_note = (f", draft acceptance rate: {100.0 * accepted / drafted:.1f}% "
                          f"({accepted} of {drafted} drafted tokens)")
        logger.info("prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
                    "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, prefix cache "
                    "hit rate: %.1f%%%s", prompt / elapsed, generation / elapsed, running,
                    waiting, usage, hit_rate, draft_note, extra={"fields": fields})
        return True
