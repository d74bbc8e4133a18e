"""The process's own heap: fewer malloc arenas, free pages handed back after a burst."""

from __future__ import annotations

import ctypes

#: glibc's mallopt parameter for the number of malloc arenas.
_M_ARENA_MAX = -8


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Ask glibc for at most ``arenas`` malloc arenas (it makes up to 8 per core, one per
    busy thread, each keeping freed memory). The gRPC worker threads otherwise grow
    the idle footprint by megabytes. True if glibc took it; a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def return_free_memory() -> bool:
    """Give the heap's free pages back to the system (glibc ``malloc_trim``): after a
    burst of requests they would otherwise stay in the resident size for good. True
    if glibc released some; a no-op elsewhere."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False
