"""KV-usage scorer: prefer instances with free KV cache blocks."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.router.scorers.base import InstanceView, RoutingRequest


class KVUsageScorer:
    """1 - fraction of KV blocks in use."""

    name = "kv_usage"

    def score(self, request: RoutingRequest,
              candidates: Sequence[InstanceView]) -> dict[str, float]:
        return {c.id: 1.0 - c.kv_usage for c in candidates}
