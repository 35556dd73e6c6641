"""A child that `pdserve up` started stops once its parent is gone, even if the parent-death
signal never reached it: here the parent exits normally, which sends no such signal."""

import subprocess
import sys
import time

from pdserve.parent_watch import PARENT_ENV, watch_parent

CHILD = """
import os, sys, time
from pdserve.parent_watch import watch_parent
assert watch_parent(interval_s=0.05)
print(os.getpid(), flush=True)
time.sleep(60)
"""


def test_child_stops_when_its_parent_is_gone(tmp_path):
    # The middle process starts the child, prints its pid, and exits at once.
    middle = (f"import os, subprocess, sys\n"
              f"env = dict(os.environ, {PARENT_ENV}=str(os.getpid()))\n"
              f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}], env=env, "
              f"stdout=subprocess.PIPE, text=True)\n"
              f"print(child.stdout.readline().strip(), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", middle], capture_output=True, text=True,
                         timeout=60)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)


def test_no_parent_named_no_watch():
    assert watch_parent(env={}) is False
    assert watch_parent(env={PARENT_ENV: "not-a-pid"}) is False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
