"""Turns on the CPU: engine processes on the same cores compute one step at a time.

Two engines that each run one compute thread per core on the same cores (a prefill and a
decode instance of `pdserve up` on one machine) slow each other down far more than their share:
every layer ends at a barrier, and a thread that the other process preempts holds up its
partners. Splitting the cores instead gives each phase a fraction of the machine even while
the other has nothing to do. Turns give every step all the cores: a process holds the turn for
a whole engine step (engine_loop.py; holding it for the model's compute only, and letting the
other's scheduling and output work preempt that compute, was slower) and then hands it on.

The turn is a file lock (`flock`), so the kernel hands it back when a holder dies. Two locks
make it fair: a process queues on `<path>.next` before it waits on `<path>`, and leaves the
queue once it holds the turn, so a process that just finished a step queues behind the one
already waiting. A turn that nobody holds or waits for is taken at once, on the stepping
thread, without the two thread wake-ups of a wait. A step never waits longer than
`max_wait_s` for a turn (a peer stuck in a step must not stop this one): it then computes
without one, and so do the steps after it until the turn comes back, with a warning at each
change.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

TURNS_ENV = "PDSERVE_CPU_TURNS"
# A peer frozen inside a step costs this once; a peer's step that is merely longer (a large
# prefill on a busy machine) only overlaps this process's next step.
DEFAULT_MAX_WAIT_S = 5.0

# What the process does with the turn: nothing (IDLE); holds it, taken on the stepping thread
# without waiting (DIRECT); waits for the keeper thread to get it (WANTED); holds it, got by
# the keeper (HELD); gave up waiting (ABANDONED). Whoever holds it, the stepping thread gives
# it back when its step ends, so the next step finds the turn IDLE and can take it at once
# (a keeper that gave it back on its own woke up after the step, and the next step, finding
# it not yet IDLE, waited through the keeper again: about 1 ms between decode steps).
_IDLE, _DIRECT, _WANTED, _HELD, _ABANDONED = "idle", "direct", "wanted", "held", "abandoned"


class CpuTurns:
    """One process's side of the turns kept in the lock file `path` (created if missing),
    for one stepping thread (a process runs one engine loop)."""

    def __init__(self, path: str, max_wait_s: float = DEFAULT_MAX_WAIT_S):
        if max_wait_s <= 0:
            raise ValueError(f"cpu_turns: max_wait_s must be > 0, got {max_wait_s}")
        self._run, self._next = _open_lock(path), _open_lock(path + ".next")
        self.path = path
        self.max_wait_s = max_wait_s
        self.turns_taken = 0
        self.turns_waited = 0  # of those taken, the ones that waited for the peer's step
        self.turns_missed = 0
        self._state = _IDLE
        self._stalled = False  # a step gave up waiting, and the keeper still waits for the lock
        self._changed = threading.Condition()
        # A turn nobody else wants is taken on the stepping thread. One that must be waited
        # for is taken on a thread of its own, so that the step can stop waiting.
        threading.Thread(target=self._keep_turns, name="cpu-turns", daemon=True).start()

    @contextlib.contextmanager
    def turn(self) -> Iterator[bool]:
        """Hold the turn for the block; yields False if it computes without one: it waited
        max_wait_s, or an earlier step did and the turn has not come back since."""
        with self._changed:
            held = None  # how this step holds the turn: _DIRECT, _HELD or not at all
            if self._stalled:
                pass
            elif self._state == _IDLE and self._take_now():
                self._state = held = _DIRECT
            else:
                self._state = _WANTED
                self._changed.notify_all()
                if self._changed.wait_for(lambda: self._state == _HELD, self.max_wait_s):
                    held = _HELD
                    self.turns_waited += 1
                else:
                    self._state = _ABANDONED  # the keeper hands it straight back when it comes
                    self._stalled = True
                    logger.warning("no CPU turn within %.0fs (%s): computing without turns "
                                   "until one comes", self.max_wait_s, self.path)
            if held is None:
                self.turns_missed += 1
        try:
            yield held is not None
        finally:
            if held is not None:
                with self._changed:
                    self.turns_taken += 1
                    _flock_now(self._run, fcntl.LOCK_UN)
                    self._state = _IDLE

    def _take_now(self) -> bool:
        """The turn, if nobody holds it or waits for it (never blocks)."""
        if not _flock_now(self._next, fcntl.LOCK_EX):
            return False
        try:
            return _flock_now(self._run, fcntl.LOCK_EX)
        finally:
            _flock_now(self._next, fcntl.LOCK_UN)

    def _keep_turns(self) -> None:
        """Get the turn for a step that waits for it; the step gives it back. A turn that
        comes after its step gave up waiting goes straight back."""
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._state == _WANTED)
            fcntl.flock(self._next, fcntl.LOCK_EX)
            fcntl.flock(self._run, fcntl.LOCK_EX)
            fcntl.flock(self._next, fcntl.LOCK_UN)
            with self._changed:
                if self._stalled:
                    self._stalled = False
                    logger.warning("CPU turns resumed (%s)", self.path)
                if self._state == _WANTED:
                    self._state = _HELD
                    self._changed.notify_all()
                else:  # ABANDONED: nobody waits for it any more
                    fcntl.flock(self._run, fcntl.LOCK_UN)
                    self._state = _IDLE


# fcntl.flock lets go of the GIL for every call. Right after a step, the threads that stream
# its outputs want the GIL, so each of a step's non-blocking flock calls waited for them to
# give it back: taking a free turn took 0.15 ms at the median and 1 ms at p90 of a decode
# instance's steps, against 0.01 ms through PyDLL, whose calls keep the GIL (harmless for
# calls that never block).
_libc = ctypes.PyDLL(None, use_errno=True)
_libc.flock.argtypes = (ctypes.c_int, ctypes.c_int)


def _flock_now(fd: int, operation: int) -> bool:
    """flock(fd, operation) without blocking; False if another open file holds the lock."""
    while _libc.flock(fd, operation | fcntl.LOCK_NB) != 0:
        err = ctypes.get_errno()
        if err == errno.EWOULDBLOCK:
            return False
        if err != errno.EINTR:  # a signal came first: try again, as fcntl.flock does
            raise OSError(err, os.strerror(err))
    return True


def _open_lock(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ValueError(f"cpu_turns: cannot open lock file {path!r}: {e.strerror}") from None


_process_turns: CpuTurns | None = None


def use_cpu_turns(path: str | None) -> CpuTurns | None:
    """Make this process's CPU engines take turns in `path` (None: they do not)."""
    global _process_turns
    _process_turns = CpuTurns(path) if path else None
    return _process_turns


def cpu_turn() -> contextlib.AbstractContextManager:
    """The turn a CPU engine step holds while it computes (nothing when turns are off)."""
    return _process_turns.turn() if _process_turns is not None else contextlib.nullcontext()
