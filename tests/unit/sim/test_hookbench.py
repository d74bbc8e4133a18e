"""gpushare.sim.hookbench: the memory hook is built from the checkout and run once per
simulated container as a runtime runs it, against the stand-in NVML: every run
succeeds and is timed; where gcc is missing the bench says so instead."""

from __future__ import annotations

import pytest

from gpushare.sim import hookbench


def test_the_sources_are_in_the_checkout() -> None:
    assert hookbench.HOOK_SOURCE.is_file() and hookbench.NVML_SOURCE.is_file()
    assert hookbench.available() in ("", "no gcc")


@pytest.mark.skipif(hookbench.available() != "", reason="the hook cannot be built here")
def test_each_container_runs_the_hook_once_and_none_fails() -> None:
    times = hookbench.measure(3)
    assert times.failures == 0
    assert len(times.seconds) == 3 and all(s > 0 for s in times.seconds)
