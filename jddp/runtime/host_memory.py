"""Host memory kept for reuse between steps on CPU: `keep_freed_memory()` sets glibc's malloc so
that XLA:CPU's step buffers reuse freed memory instead of faulting in fresh pages every step.

Importing jddp changes nothing: jddp's own programs (`python -m experiments.train`, the benchmarks,
the calibration) call it, and a program of yours may, first thing, before JAX starts its threads
(an arena is chosen by a thread's first allocation). See docs/trainer.md, "Host memory on CPU".

Why: XLA:CPU allocates each execution's temporary and output buffers with malloc and frees them
after it. glibc serves a large allocation (above its mmap threshold, 128 KiB-32 MiB, and in a
thread's arena anything beyond the arena's 64 MiB heap) with a fresh mmap and unmaps it on free,
so every step writes to new pages: a page fault and a zeroed page per 4 KiB, in the kernel, on
the cores the step computes on (the communication benchmark's 10.5M-parameter MLP: 20,500 faults
and 150 ms a step, 87 ms without them). So: one arena (XLA's worker threads would otherwise get
per-thread heaps capped at 64 MiB, whose larger buffers still go to mmap), no mmap below 1 GiB,
and no trimming of the heap's free top. Trimming is off, not merely set high: the largest positive
`mallopt` threshold, 2 GiB, is passed by a big step's temporaries (tensor:8 on 8 simulated
devices), which would then be given back at the end of every step and faulted in again in the
next. PyTorch's CPU performance guides say the same and point to jemalloc / tcmalloc; this needs
neither. The cost: a process keeps its peak host memory instead of returning it between steps.

Left alone where glibc is not the C library, where the user set glibc's malloc options already
(MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, or glibc.malloc tunables in
GLIBC_TUNABLES), or with JDDP_MALLOC_TUNING=0 (or false, off, no).
"""

import ctypes
import os
import resource
import sys

OPT_OUT = "JDDP_MALLOC_TUNING"
# (glibc's environment variable, mallopt's parameter in malloc.h, the value set)
_SETTINGS = (
    ("MALLOC_ARENA_MAX", -8, 1),  # one arena: the main heap, which has no size cap
    ("MALLOC_MMAP_THRESHOLD_", -3, 1 << 30),  # mmap only what is above 1 GiB
    ("MALLOC_TRIM_THRESHOLD_", -1, -1),  # never trim: glibc reads -1 as the largest size
)
# The same settings as environment variables, for a child process that does not call
# `keep_freed_memory` (PyTorch in the benchmarks). They take a size, not -1: 2**62 bytes is
# beyond any heap.
ENVIRONMENT = {name: str(value if value > 0 else 1 << 62) for name, _, value in _SETTINGS}


def minor_faults() -> int:
    """Pages this process has taken fresh from the OS so far (its minor page faults)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def user_chose() -> bool:
    """True when this process's environment already decides glibc's malloc behaviour."""
    if os.environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "off", "no"):
        return True
    if any(name in os.environ for name in ENVIRONMENT):
        return True
    return "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def glibc() -> ctypes.CDLL | None:
    """This process's C library, if it is glibc (musl and others have no arenas to set)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep freed memory for reuse (see the module docstring); returns
    whether it did."""
    libc = None if user_chose() else glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return all(libc.mallopt(param, value) == 1 for _, param, value in _SETTINGS)
