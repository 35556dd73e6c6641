"""A child of `pdserve up` stops when `up` is gone, whatever ended it.

The parent-death signal (cluster.py) stops most children at once, but a parent killed while
a child is still between fork and exec can slip past it. So a child that `up` started (it
names itself by `PDSERVE_PARENT_PID`) also checks its parent twice a second, and sends itself
SIGTERM, its normal graceful stop, once the parent is no longer that process.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping

PARENT_ENV = "PDSERVE_PARENT_PID"


def watch_parent(env: Mapping[str, str] = os.environ, interval_s: float = 0.5) -> bool:
    """Start the watch when `env` names a parent; True if it did."""
    try:
        parent = int(env.get(PARENT_ENV, ""))
    except ValueError:
        return False

    def watch() -> None:
        while True:
            if os.getppid() != parent:  # reparented: the parent died
                os.kill(os.getpid(), signal.SIGTERM)  # again each round until we are gone
            time.sleep(interval_s)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    return True
