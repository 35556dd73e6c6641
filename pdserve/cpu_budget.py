"""The CPU budget of an engine process: which cores it runs on, how many compute threads it
starts, and how long those threads spin at a barrier before they sleep.

On shared cores, OpenMP's default wait (libgomp spins 300,000 times at every barrier) burns the
time slice of a thread whose partner was descheduled: beside one other busy process, pdserve's
tokens per CPU-second fell 4.6x. Since a step's layers run in one native call
(kernels/cpu_layers.py), the gaps between barriers are microseconds: a spin of 1,000 keeps the
quiet-machine speed and loses under a tenth beside a busy process, where 10,000 now lost half
(benchmarks/results/cpu_budget.md), so pdserve sets `GOMP_SPINCOUNT=1000` unless the
environment sets it. Both settings must be made before torch is imported (libgomp reads them
once): `pdserve/__init__.py` and the CLI do that. `pdserve up` runs its engine processes on
all the cores, taking turns (cpu_turns.py), or gives each its own cores (`split_cores`).

libgomp also cuts the spin to a "throttled" 100 whenever the process holds more OpenMP
threads than cores, and a server does: its engine steps on its own thread (engine_loop.py)
while the thread that loaded the model keeps an idle pool, as do the KV transports' threads.
The engine's threads then sleep and wake at every barrier (a decode step of 8 sequences 17.7
instead of 14.0 ms). `OMP_WAIT_POLICY=active` raises that count to 1,000 (never above
GOMP_SPINCOUNT), which keeps the speed (15.1-15.8 ms against 15.4-15.5 on the main thread,
same run). pdserve sets it unless the environment does, and only where torch ships libgomp:
LLVM's and Intel's OpenMP read "active" as "spin without end".
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from pdserve.cpu_turns import TURNS_ENV

SPIN_ENV = "GOMP_SPINCOUNT"
DEFAULT_SPIN = "1000"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
CORES_ENV = "PDSERVE_CPU_CORES"


def torch_ships_libgomp() -> bool:
    """Whether the installed torch carries GNU OpenMP (the Linux wheels), found without
    importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    package = Path(spec.origin).parent
    return any(any(folder.glob("libgomp*")) for folder in (package / "lib",
                                                            package.parent / "torch.libs"))


def set_openmp_defaults() -> None:
    """The spin and wait-policy defaults above, unless the environment sets them; call before
    torch is imported."""
    os.environ.setdefault(SPIN_ENV, DEFAULT_SPIN)
    if WAIT_POLICY_ENV not in os.environ and torch_ships_libgomp():
        os.environ[WAIT_POLICY_ENV] = "active"


def parse_cores(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]; ValueError naming --cpu-cores when malformed."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            first, dash, last = part.strip().partition("-")
            lo, hi = int(first), int(last if dash else first)
            if lo < 0 or hi < lo:
                raise ValueError
            cores.extend(range(lo, hi + 1))
    except ValueError:
        raise ValueError(f"cpu_cores: expected core ids such as 0-3,6, got {text!r}") from None
    return sorted(set(cores))


def format_cores(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def available_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def split_cores(num_processes: int, cores: list[int] | None = None) -> list[list[int]]:
    """Give each of `num_processes` engine processes its own cores: contiguous, disjoint
    shares while there are enough cores, else cores shared round-robin (one each)."""
    cores = available_cores() if cores is None else cores
    if num_processes <= 0:
        return []
    if num_processes > len(cores):
        return [[cores[i % len(cores)]] for i in range(num_processes)]
    share, extra = divmod(len(cores), num_processes)
    out, start = [], 0
    for i in range(num_processes):
        size = share + (i < extra)
        out.append(cores[start:start + size])
        start += size
    return out


def apply_cpu_budget(cores: list[int] | None) -> None:
    """Pin this process to `cores` (None: keep its cores) with one compute thread per core.
    Call before torch is imported; if it already is, its thread count is still set."""
    if cores:
        allowed = set(available_cores())
        missing = [c for c in cores if c not in allowed]
        if missing:
            raise ValueError(f"cpu_cores: {format_cores(missing)} not available to this "
                             f"process (it may use {format_cores(sorted(allowed))})")
        os.sched_setaffinity(0, cores)
        os.environ["OMP_NUM_THREADS"] = str(len(cores))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(len(cores))


def add_cpu_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-cores", default=os.environ.get(CORES_ENV),
                        help="run the engine on these cores only, one compute thread each "
                             f"(e.g. 0-3,6; env {CORES_ENV}; default: every core this "
                             "process may use)")
    parser.add_argument("--cpu-turns", default=os.environ.get(TURNS_ENV), metavar="LOCK_FILE",
                        help="take turns computing steps with the other engine processes "
                             "that name this lock file (cpu_turns.py; env "
                             f"{TURNS_ENV}; default: no turns)")


def cores_from_args(args: argparse.Namespace) -> list[int] | None:
    text = getattr(args, "cpu_cores", None)
    return parse_cores(text) if text else None
