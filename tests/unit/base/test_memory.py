"""gpushare.base.memory: glibc takes the arena limit and the heap trim (the daemon calls
both: at start and after a burst of requests)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpushare.base.memory import limit_malloc_arenas, return_free_memory


def glibc() -> bool:
    import platform

    return platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not glibc(), reason="mallopt and malloc_trim are glibc's")
def test_glibc_takes_the_arena_limit() -> None:
    # In a child: the limit holds for the rest of the process that sets it.
    code = "from gpushare.base.memory import limit_malloc_arenas as l; print(l(2), l(1))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


#: In a child: 64 KiB blocks (malloc'd, below the mmap threshold) with small malloc'd
#: blocks kept between them, so that freeing the big ones leaves free pages in the middle
#: of the heap, which free() itself never hands back and only a trim does.
BURST = """
from gpushare.base.memory import return_free_memory
kept, big = [], []
for _ in range(2000):
    big.append(bytearray(64 * 1024))
    kept.append(bytearray(1024))
del big
print(return_free_memory())
"""


@pytest.mark.skipif(not glibc(), reason="mallopt and malloc_trim are glibc's")
def test_a_trim_after_a_burst_hands_pages_back_once() -> None:
    out = subprocess.run([sys.executable, "-c", BURST], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"]  # the holes' pages went back


def test_both_answer_a_bool() -> None:
    assert isinstance(limit_malloc_arenas(8), bool)
    assert isinstance(return_free_memory(), bool)
