"""Freed host memory kept for reuse by a CPU engine (glibc's malloc).

A step over a long prompt allocates activations of tens of megabytes (2,000 tokens of
SmolLM2's MLP: 25 MB). glibc serves blocks that large with fresh mappings, returns them to the
kernel when they are freed, and trims free memory at the heap's top: every step then faults
its activations in again, each page zeroed by the kernel. That was a tenth of the time of a
cold 2,000-token prefill (benchmarks/results/vs_vllm.md). A CPU engine raises both thresholds
once, so freed blocks stay in the heap for the next step, as a GPU framework's caching
allocator keeps device memory; the process keeps its peak activation memory until
`release_freed_memory` (the engine's sleep) gives the free part back.

glibc's own environment variables (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) win when
set. Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # blocks up to this size come from the heap and go back to it
_SETTINGS = ((M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_"),
             (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_"))


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to KEEP_BYTES, each unless its environment
    variable is set; True when both are in force, False on another C library."""
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        glibc = None
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if not glibc or mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = True
    for param, env in _SETTINGS:
        if env not in os.environ:
            done = bool(mallopt(param, KEEP_BYTES)) and done
    return done


def release_freed_memory() -> None:
    """Give the heap's free memory back to the OS (glibc's malloc_trim), after a large free
    such as the engine's sleep; a no-op on another C library."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
        trim(0)
