"""Prefix-overlap scorer: the fraction of the prompt's blocks an instance already caches."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.router.scorers.base import InstanceView, RoutingRequest


class PrefixOverlapScorer:
    """matched leading blocks / prompt blocks (0 for a prompt shorter than one block)."""

    name = "prefix"

    def score(self, request: RoutingRequest,
              candidates: Sequence[InstanceView]) -> dict[str, float]:
        if request.num_blocks <= 0:
            return {c.id: 0.0 for c in candidates}
        return {c.id: min(1.0, request.prefix_matches.get(c.id, 0) / request.num_blocks)
                for c in candidates}
