"""Pickers: choose one instance among the candidates (filters -> weighted scorers -> picker).

`WeightedPicker` sums each scorer's [0, 1] scores times its weight and takes the best;
`RoundRobinPicker` ignores scores (the baseline).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.router.scorers import (
    InstanceView,
    KVUsageScorer,
    PrefixOverlapScorer,
    QueueScorer,
    RoutingRequest,
    Scorer,
)


class NoCandidateError(ValueError):
    """No instance can take the request (none live with the wanted role)."""


class Picker(Protocol):
    def pick(self, request: RoutingRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        ...


def filter_role(candidates: Sequence[InstanceView], role: str) -> list[InstanceView]:
    """Candidates that can serve `role` ("prefill" or "decode"); colocated ones ("both") can."""
    return [c for c in candidates if c.role in (role, "both")]


@dataclass(frozen=True)
class PickerConfig:
    """Scorer weights (0 disables a scorer). Prefix 2 : queue 1 was tuned on the Mooncake
    conversation trace (benchmarks/routing.py): cache affinity first, load spreads ties and
    keeps a hot prefix from piling onto one instance."""

    prefix_weight: float = 2.0
    queue_weight: float = 1.0
    kv_usage_weight: float = 0.0
    queue_by: str = "tokens"  # "tokens" or "requests"

    def __post_init__(self) -> None:
        weights = (self.prefix_weight, self.queue_weight, self.kv_usage_weight)
        if any(w < 0 for w in weights) or not any(w > 0 for w in weights):
            raise ValueError(f"picker weights must be >= 0 with one > 0, got {weights}")


class WeightedPicker:
    """Best weighted score. Ties go to fewer queued tokens, then fewer queued requests; a tie
    that remains (e.g. an idle cluster) rotates through the tied ids in id order, so the first
    such tie picks the smallest id and an idle cluster still spreads its requests."""

    def __init__(self, scorers: Sequence[tuple[Scorer, float]]):
        self.scorers = [(s, w) for s, w in scorers if w > 0]
        if not self.scorers:
            raise ValueError("WeightedPicker needs at least one scorer with a positive weight")
        self._total = sum(w for _, w in self.scorers)
        self._ties = itertools.count()

    @classmethod
    def from_config(cls, config: PickerConfig) -> WeightedPicker:
        return cls([(PrefixOverlapScorer(), config.prefix_weight),
                    (QueueScorer(config.queue_by), config.queue_weight),
                    (KVUsageScorer(), config.kv_usage_weight)])

    def scores(self, request: RoutingRequest,
               candidates: Sequence[InstanceView]) -> dict[str, float]:
        """Weighted mean of the scorers' outputs per candidate id, in [0, 1]."""
        total = dict.fromkeys((c.id for c in candidates), 0.0)
        for scorer, weight in self.scorers:
            for cid, s in scorer.score(request, candidates).items():
                total[cid] += weight * s
        return {cid: s / self._total for cid, s in total.items()}

    def pick(self, request: RoutingRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        if not candidates:
            raise NoCandidateError("no live instance to route to")
        scores = self.scores(request, candidates)
        rank = {c.id: (-scores[c.id], c.queued_tokens, c.queued_requests) for c in candidates}
        best = min(rank.values())
        tied = sorted((c for c in candidates if rank[c.id] == best), key=lambda c: c.id)
        if len(tied) == 1:
            return tied[0]
        return tied[next(self._ties) % len(tied)]


class RoundRobinPicker:
    """Each call takes the next candidate in id order (thread-safe enough: one shared counter)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, request: RoutingRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        if not candidates:
            raise NoCandidateError("no live instance to route to")
        ordered = sorted(candidates, key=lambda c: c.id)
        return ordered[next(self._counter) % len(ordered)]
