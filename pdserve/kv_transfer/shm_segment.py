"""Named POSIX shared-memory segments (files under /dev/shm) owned by one process.

A segment's name records its owner: `pdserve-kv-<pidns>-<pid>-<starttime>-<token>-<engine>`, so
any process in the same PID namespace can tell whether the owner is still alive (pid reuse is
caught by the start time) and remove segments left behind by a crashed owner.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

PREFIX = "pdserve-kv-"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(\d+)-[0-9a-f]+-")


_FULL_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(\d+)-[0-9a-f]{{8}}-[A-Za-z0-9_.]{{1,64}}$")


def check_segment_path(path: str, shm_dir: str, owner: tuple[int, int, int]) -> str:
    """`path` if it names a pdserve segment directly in `shm_dir` whose name records `owner`
    (pid, start time, pid namespace); otherwise ValueError. A descriptor comes off the wire:
    this keeps a forged one from making a consumer map, or unlink, any other file."""
    name = os.path.basename(path)
    match = _FULL_NAME_RE.match(name)
    if os.path.join(shm_dir, name) != path or match is None:
        raise ValueError(f"segment {path!r} is not a pdserve KV segment in {shm_dir}")
    pidns, pid, start = (int(g) for g in match.groups())
    if (pid, start, pidns) != tuple(owner):
        raise ValueError(f"segment {path!r} does not belong to the owner the descriptor names")
    return path


def pid_namespace() -> int:
    """Inode of this process's PID namespace (0 if unknown)."""
    try:
        return int(re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or 0)
    except OSError:
        return 0


def process_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live, non-zombie process; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # fields[0] is field 3 (state)
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def owner_alive(pid: int, start_time: int, pidns: int) -> bool:
    """True unless the owner is known dead (a different PID namespace is assumed alive)."""
    if pidns == 0 or pidns != pid_namespace():
        return True
    return process_start_time(pid) == start_time


def new_segment_name(engine_id: str) -> tuple[str, dict[str, int]]:
    """A fresh segment name for this process and the owner fields a descriptor carries."""
    pid = os.getpid()
    owner = {"pid": pid, "pid_start": process_start_time(pid) or 0, "pidns": pid_namespace()}
    safe = re.sub(r"[^A-Za-z0-9_.]", "_", engine_id)[:64] or "engine"
    name = f"{PREFIX}{owner['pidns']}-{pid}-{owner['pid_start']}-{secrets.token_hex(4)}-{safe}"
    return name, owner


def create_segment(path: str, nbytes: int) -> mmap.mmap:
    """Create a zeroed segment file of `nbytes` and map it read-write, pages populated."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _populate(),
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def map_segment_readonly(path: str, nbytes: int) -> tuple[mmap.mmap, int]:
    """Map an existing segment read-only; return (mapping, inode). Raises OSError/ValueError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_size != nbytes:
            raise ValueError(f"segment {path} has {st.st_size} bytes, layout needs {nbytes}")
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _populate(), prot=mmap.PROT_READ)
        return mm, st.st_ino
    finally:
        os.close(fd)


def unlink_if_owner(path: str, owner_pid: int) -> None:
    """Unlink `path` when called in the owning process (forked children must not)."""
    if os.getpid() == owner_pid:
        unlink_quietly(path)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sweep_stale_segments(shm_dir: str) -> list[str]:
    """Remove segments in `shm_dir` whose owner (in this PID namespace) is dead; return them."""
    removed: list[str] = []
    ns = pid_namespace()
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if not m or int(m.group(1)) != ns or ns == 0:
            continue
        if not owner_alive(int(m.group(2)), int(m.group(3)), ns):
            unlink_quietly(os.path.join(shm_dir, name))
            removed.append(name)
    return removed


def _populate() -> int:
    return getattr(mmap, "MAP_POPULATE", 0)
