"""Requests this router has sent to each decode instance and not yet seen end.

The instances' own load reports arrive once a second; a burst of requests routed in between
would all read the same stale count. This count moves with every request, so the routing
rules that look at a decode instance's load (`RouterConfig.disagg_min_running`) read the
larger of the two. A request that migrates to another decode instance stays counted on its
first one until it ends.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class OpenRequests:
    """Thread-safe count of this router's open requests per decode instance id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def count(self, instance_id: str) -> int:
        with self._lock:
            return self._counts[instance_id]

    @contextmanager
    def holding(self, instance_id: str) -> Iterator[None]:
        """Count one request on `instance_id` for the duration of the block."""
        with self._lock:
            self._counts[instance_id] += 1
        try:
            yield
        finally:
            with self._lock:
                self._counts[instance_id] -= 1
                if not self._counts[instance_id]:
                    del self._counts[instance_id]
