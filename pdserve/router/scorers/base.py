"""What scorers see: a snapshot of each candidate instance and of the request being routed.

A scorer maps (request, candidates) to a score in [0, 1] per candidate id, higher is better.
Scorers are pure: same inputs, same scores; no I/O (the prefix index is asked before scoring).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class InstanceView:
    """One instance as the router sees it, from its latest heartbeat."""

    id: str
    role: str = "prefill"  # "prefill", "decode" or "both" (colocated)
    address: str = ""
    queued_requests: int = 0  # waiting, not yet scheduled
    queued_tokens: int = 0  # prompt tokens still to compute (waiting + partially prefilled)
    running_requests: int = 0
    free_blocks: int = 0  # KV cache blocks not held by a request
    total_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks held by requests (0 when the instance did not say)."""
        if self.total_blocks <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.free_blocks / self.total_blocks))

    @classmethod
    def from_info(cls, instance_id: str, info: Mapping[str, Any]) -> InstanceView:
        """Build from heartbeat info (`PrefixIndex.instances()` values); unknown keys ignored."""
        return cls(
            id=instance_id,
            role=str(info.get("role", "prefill")),
            address=str(info.get("address", "")),
            queued_requests=int(info.get("queued_requests", 0)),
            queued_tokens=int(info.get("queued_tokens", 0)),
            running_requests=int(info.get("running_requests", 0)),
            free_blocks=int(info.get("free_blocks", 0)),
            total_blocks=int(info.get("total_blocks", 0)),
        )


@dataclass(frozen=True)
class RoutingRequest:
    """The request being routed, as scorers need it."""

    num_prompt_tokens: int
    num_blocks: int  # full prompt blocks, i.e. len(block hashes)
    prefix_matches: Mapping[str, int] = field(default_factory=dict)  # PrefixIndex.match()


class Scorer(Protocol):
    """Scores in [0, 1] per candidate id; the picker weighs them by `name`."""

    name: str

    def score(self, request: RoutingRequest,
              candidates: Sequence[InstanceView]) -> dict[str, float]: ...
