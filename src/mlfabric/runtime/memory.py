"""Giving freed memory back to the operating system.

glibc's malloc serves blocks below its mmap threshold from its heap, and
that threshold rises (up to 32 MiB) each time a larger mmapped block is
freed. So after a few large frames, the buffers of later ones come from the
heap, and once they are freed the heap keeps their pages unless they lie at
its very top. Python has freed them, but the process's resident memory does
not fall. Measured (issue 33): 16 clients that left halfway through a 16 MiB
push left a server 140 MiB larger for good in a fresh install, and
none in another, depending only on the allocation history before. This is
the problem dask's workers hit, and the same remedy:
`malloc_trim(0)` returns the free pages anywhere in the heap.

The controller has the opposite need (`reuse_freed_blocks`): a re-plan over
10,000 pending transfers allocates arrays of one number per link (two per
host: 160 KB), above glibc's first mmap threshold, and frees them when it
ends. Measured with `benchmarks/bench_replan.py`: about 400 page faults
per event (half of them in the re-plan, 0.9 ms of system time on this
machine: a sixth of it), and none once blocks up to 4 MiB come from a heap
that keeps 64 MiB of freed pages.

`give_back_soon()` asks for one trim once the running callbacks are done,
after a connection that may have held a large buffer closes: connections
closing in one turn of the loop share it. A trim takes well under a
millisecond here (0.06 ms with 120 MiB freed in 8 MiB blocks). Where
there is no glibc (musl, macOS), it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable


def _find_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def _find_mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


_trim = _find_trim()
_mallopt = _find_mallopt()
HAS_MALLOPT = _mallopt is not None  # reuse_freed_blocks can act (glibc)
# malloc.h's parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
REUSE_BELOW = 4 << 20  # blocks up to this come from the heap ...
KEEP_FREED = 64 << 20  # ... which keeps up to this much freed memory for the next ones


def reuse_freed_blocks() -> bool:
    """Serve blocks up to `REUSE_BELOW` from the heap and keep up to
    `KEEP_FREED` bytes of its freed pages, so that work which allocates and
    frees the same large arrays over and over (the controller's re-plans)
    reuses pages instead of faulting fresh ones in each time. For a process
    whose blocks are small and many (the controller), not one that holds
    frames of many MiB (servers: see `give_back`). Whether it could (glibc
    only)."""
    if _mallopt is None:
        return False
    return bool(_mallopt(_M_MMAP_THRESHOLD, REUSE_BELOW)) and bool(
        _mallopt(_M_TRIM_THRESHOLD, KEEP_FREED))


_pending: set[asyncio.AbstractEventLoop] = set()


def give_back() -> bool:
    """Return the heap's free pages to the OS now; whether it could."""
    if _trim is None:
        return False
    _trim(0)
    return True


def give_back_soon() -> None:
    """One `give_back` on the running loop once its ready callbacks have
    run, unless one is already due."""
    if _trim is None:
        return
    loop = asyncio.get_running_loop()
    if loop in _pending:
        return
    _pending.add(loop)

    def trim() -> None:
        _pending.discard(loop)
        give_back()

    loop.call_soon(trim)
