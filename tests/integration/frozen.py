"""Freezing a process for a test: SIGSTOP, then wait until every thread has stopped."""

import os
import signal
import time
from pathlib import Path


def thread_states(pid: int) -> list[str]:
    """The state letter of each of `pid`'s threads (/proc/PID/task/TID/stat)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return states


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """Stop `pid` and return once all its threads are stopped: kill() returns before a busy
    thread on another core has taken the stop, and it could still answer one request."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not all(state in "Tt" for state in thread_states(pid)):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop: {thread_states(pid)}")
        time.sleep(0.005)
