"""Queue scorer: prefer instances with less queued work, normalised across the candidates."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.router.scorers.base import InstanceView, RoutingRequest


class QueueScorer:
    """Min-max normalised queue depth: the least loaded candidate scores 1, the most loaded 0,
    the rest linearly between; all equal scores 1 for everyone.

    `by="tokens"` counts queued prompt tokens (work), `by="requests"` queued requests.
    """

    name = "queue"

    def __init__(self, by: str = "tokens"):
        if by not in ("tokens", "requests"):
            raise ValueError(f"queue scorer: by must be 'tokens' or 'requests', got {by!r}")
        self.by = by

    def load(self, c: InstanceView) -> int:
        return c.queued_tokens if self.by == "tokens" else c.queued_requests

    def score(self, request: RoutingRequest,
              candidates: Sequence[InstanceView]) -> dict[str, float]:
        loads = {c.id: self.load(c) for c in candidates}
        if not loads:
            return {}
        lo, hi = min(loads.values()), max(loads.values())
        if hi == lo:
            return dict.fromkeys(loads, 1.0)
        return {i: (hi - q) / (hi - lo) for i, q in loads.items()}
