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


@pytest.mark.skipif(not glibc(), reason="mallopt and malloc_trim are glibc's")
def test_a_trim_after_a_burst_hands_pages_back() -> None:
    burst = [bytearray(64 * 1024) for _ in range(2000)]  # ~128 MiB on the heap
    del burst
    assert return_free_memory() is True


def test_both_answer_a_bool() -> None:
    assert isinstance(limit_malloc_arenas(8), bool)
    assert isinstance(return_free_memory(), bool)
