"""Issue 32.11: a server that ends every watch at once (a 410 for every watch, or an
empty watch ended at once) must not get a busy loop of watches and full lists.

The daemon's pod watch and the extender's pod feed share the loop
(:func:`gpushare.kube.watching.run_until_stopped`); it is driven here through the
daemon's, over HTTP against the API-server double, which counts the requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.procs import eventually

from gpushare.kube.podspecs import PodSpecBook
from gpushare.kube.podwatch import PodWatch
from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint
from gpushare.kube.watching import FIRST_PAUSE
from gpushare.sim.apidouble import KubeApiDouble, Recorded

NODE = "gpu-node-1"


@pytest.fixture
def double() -> Iterator[KubeApiDouble]:
    api = KubeApiDouble()
    api.start()
    try:
        yield api
    finally:
        api.stop()


def watches(api: KubeApiDouble) -> list[Recorded]:
    return [r for r in api.calls("GET", "/api/v1/pods") if "watch" in r.query]


def lists(api: KubeApiDouble) -> list[Recorded]:
    return [r for r in api.calls("GET", "/api/v1/pods") if "watch" not in r.query]


@pytest.mark.parametrize("fault", ["gone", "end"])
def test_watches_ended_at_once_are_spaced_by_a_growing_pause(
    double: KubeApiDouble, short_tmp: Path, fault: str
) -> None:
    double.watch_fault = fault
    client = ApiClient(kubeconfig_endpoint(double.kubeconfig(short_tmp / "kubeconfig")))
    watch = PodWatch(lambda: client, NODE, PodSpecBook("gpushare.io"))
    watch.start()
    try:
        opened = eventually(lambda: w if len(w := watches(double)) >= 4 else None, 60.0)
    finally:
        watch.stop()
        client.close()
    gaps = [b.at - a.at for a, b in itertools.pairwise(opened)][:3]
    # Each pause at least doubles the last (jitter 0.8 to 1.2): 0.5, 1, 2 s, where
    # the loop without a pause opened hundreds of watches a second.
    for n, gap in enumerate(gaps):
        assert gap >= FIRST_PAUSE * 2**n * 0.8, (n, gaps)
    listed = [r for r in lists(double) if r.at <= opened[3].at]
    if fault == "gone":
        assert len(listed) <= 4  # one full list per cycle, never more
    else:
        assert len(listed) == 1  # a watch that ended normally resumes: no list
