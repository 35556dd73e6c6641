"""Decode streams that go silent. A frozen decode instance (stopped, or its host gone without
closing the connection) never ends its stream, and no keepalive runs on these channels, so a
client would wait until its deadline. One thread checks every registered stream: when one has
sent nothing for `silence_s`, its instance is probed (one probe per instance per round). An
instance that answers is slow, not dead, and its streams wait on; one that does not has its
streams cancelled and marked `dead`, so their flows retry or migrate as for a dropped stream.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from pdserve.router.registry import Instance

logger = logging.getLogger(__name__)


class WatchedStream:
    """One decode call under watch; the flow calls `seen()` on every message."""

    def __init__(self, call: Any, instance: Instance, now: float):
        self.call, self.instance, self.last = call, instance, now
        self.dead = False  # the watch cancelled the call: its instance did not answer

    def seen(self) -> None:
        self.last = time.monotonic()


class StreamWatch:
    """Probes the instances of streams silent for `silence_s` with `is_down(instance)`."""

    def __init__(self, silence_s: float, is_down: Callable[[Instance], bool]):
        self.silence_s = silence_s
        self.is_down = is_down
        self._lock = threading.Lock()
        self._streams: set[WatchedStream] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, call: Any, instance: Instance) -> Iterator[WatchedStream]:
        stream = WatchedStream(call, instance, time.monotonic())
        with self._lock:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-watch",
                                                daemon=True)
                self._thread.start()
        try:
            yield stream
        finally:
            with self._lock:
                self._streams.discard(stream)

    def check(self) -> None:
        """One round: probe the instances of silent streams; cancel those of dead ones."""
        now = time.monotonic()
        with self._lock:
            silent = [s for s in self._streams if not s.dead and now - s.last > self.silence_s]
        by_instance: dict[str, list[WatchedStream]] = {}
        for stream in silent:
            by_instance.setdefault(stream.instance.id, []).append(stream)
        for streams in by_instance.values():
            instance = streams[0].instance
            if not self.is_down(instance):
                for stream in streams:
                    stream.last = max(stream.last, now)  # slow, not dead: wait another round
                continue
            logger.warning("decode instance %s sent nothing for %.0f s and does not answer: "
                           "ending its %d streams here", instance.id, self.silence_s,
                           len(streams))
            for stream in streams:
                stream.dead = True
                stream.call.cancel()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(self.silence_s / 2, 5.0)):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watch must outlive any one round
                logger.exception("stream watch: a round failed")
