"""CPU turns between real processes: one step at a time, fair, and never stuck behind a peer."""

import fcntl
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pdserve.cpu_turns import CpuTurns

# A process that takes `n` turns on LOCK, each `hold_s` long, and prints each turn's
# (start, end) on the machine-wide monotonic clock.
TAKER = textwrap.dedent("""
    import json, sys, time
    from pdserve.cpu_turns import CpuTurns
    lock, n, hold_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    turns = CpuTurns(lock)
    print("ready", flush=True)
    sys.stdin.readline()  # go
    spans = []
    for _ in range(n):
        with turns.turn() as granted:
            assert granted
            start = time.monotonic()
            time.sleep(hold_s)
            spans.append((start, time.monotonic()))
    print(json.dumps(spans), flush=True)
""")

# A process that takes one turn and keeps it until its stdin closes (or it is killed).
HOLDER = textwrap.dedent("""
    import sys
    from pdserve.cpu_turns import CpuTurns
    with CpuTurns(sys.argv[1]).turn():
        print("holding", flush=True)
        sys.stdin.read()
""")


def spawn(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_two_processes_compute_one_at_a_time_and_alternate(tmp_path):
    lock = tmp_path / "turns"
    takers = [spawn(TAKER, lock, 12, 0.01) for _ in range(2)]
    try:
        for p in takers:
            assert p.stdout.readline().strip() == "ready"
        for p in takers:
            p.stdin.write("go\n")
            p.stdin.flush()
        spans = [json.loads(p.communicate(timeout=60)[0]) for p in takers]
    finally:
        for p in takers:
            p.kill()
    timeline = sorted((start, end, who) for who, mine in enumerate(spans)
                      for start, end in mine)
    for (_, end, _), (start, _, _) in zip(timeline, timeline[1:]):
        assert end <= start  # never two turns at once
    # While both want turns they alternate: a process that just had one queues behind the
    # other's waiting step. (A plain lock goes back to the process that just let go of it.)
    # Slack for a process that the machine's load keeps from queueing again in time.
    owners = [who for _, _, who in timeline]
    last_both = min(max(i for i, w in enumerate(owners) if w == who) for who in (0, 1))
    contended = owners[:last_both + 1]
    switches = sum(1 for a, b in zip(contended, contended[1:]) if a != b)
    assert switches >= len(contended) // 2, owners


def test_a_dead_holder_hands_the_turn_back(tmp_path):
    lock = tmp_path / "turns"
    holder = spawn(HOLDER, lock)
    assert holder.stdout.readline().strip() == "holding"
    holder.kill()
    holder.wait(10)
    turns = CpuTurns(str(lock), max_wait_s=60)
    with turns.turn() as granted:
        assert granted
    assert (turns.turns_taken, turns.turns_missed) == (1, 0)


def test_a_stuck_holder_delays_a_step_only_max_wait_s(tmp_path):
    lock = tmp_path / "turns"
    holder = spawn(HOLDER, lock)
    try:
        assert holder.stdout.readline().strip() == "holding"
        turns = CpuTurns(str(lock), max_wait_s=0.3)
        started = time.monotonic()
        with turns.turn() as granted:
            assert not granted  # computed without a turn rather than wait on the holder
        assert time.monotonic() - started < 30  # bounded: the holder still holds it
        turns.max_wait_s = 60
        started = time.monotonic()
        with turns.turn() as granted:
            assert not granted  # nor do the next steps wait, until the turn comes back
        assert time.monotonic() - started < 30
        assert turns.turns_missed == 2
    finally:
        holder.stdin.close()  # the holder hands the turn back and exits
        holder.wait(10)
    deadline = time.monotonic() + 60
    granted = False
    while not granted and time.monotonic() < deadline:  # until the keeper has the lock back
        with turns.turn() as granted:
            pass
        time.sleep(0.01)
    assert granted  # turns resumed
    assert turns.turns_taken == 1


def let_go_once_queued(lock, holder) -> None:
    """Close the holder's stdin once a step of this process waits in the queue (its keeper
    holds `<lock>.next`), so that the step surely gets its turn through the keeper."""
    probe = os.open(f"{lock}.next", os.O_RDWR)
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                break
            fcntl.flock(probe, fcntl.LOCK_UN)
            time.sleep(0.01)
    finally:
        os.close(probe)
        holder.stdin.close()


def test_a_step_gives_the_turn_back_as_it_ends(tmp_path):
    """A step that waited for its turn (the keeper thread got it) gives it back itself, the
    moment it ends: the other process need not wait for a thread of this one to wake up, and
    this process's next step finds it free and takes it at once."""
    lock = tmp_path / "turns"
    holder = spawn(HOLDER, lock)
    try:
        assert holder.stdout.readline().strip() == "holding"
        turns = CpuTurns(str(lock), max_wait_s=60)
        threading.Thread(target=let_go_once_queued, args=(lock, holder), daemon=True).start()
        with turns.turn() as granted:
            assert granted
        with turns.turn() as granted:
            assert granted
        assert (turns.turns_taken, turns.turns_waited, turns.turns_missed) == (2, 1, 0)
        other = os.open(lock, os.O_RDWR)  # another open file: its own flock
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if still held
        finally:
            os.close(other)
    finally:
        holder.kill()
        holder.wait(10)


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="cpu_turns: cannot open lock file"):
        CpuTurns(str(tmp_path / "missing-dir" / "turns"))
    with pytest.raises(ValueError, match="cpu_turns: max_wait_s"):
        CpuTurns(str(tmp_path / "turns"), max_wait_s=0)


def test_the_cli_refuses_a_lock_file_it_cannot_open(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "decode", "--cpu-turns",
         str(tmp_path / "missing-dir" / "turns")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "error: cpu_turns: cannot open lock file" in done.stderr
