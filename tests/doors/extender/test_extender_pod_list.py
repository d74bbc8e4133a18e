"""The extender's first pod list: one list, read as a stream, however slow.

A list slower than ``START_LIST_SECONDS`` used to be abandoned while it ran and a
second full list started beside it (at 50 000 pods: 42 s and 194 MB to ready, against
25 s and 136 MB with one list). Now the extender serves after that wait with the
filter held back (``/readyz`` 503) while the same list goes on.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kit.extender import (
    CORE,
    MEMORY,
    PREFIX,
    RunningExtender,
    api,
    container,
    extender_factory,
    get,
    pod,
)
from kit.kube_double import KubeApiDouble
from kit.procs import eventually

from gpushare.extender import podfeed

__all__ = ["api", "extender_factory"]  # fixture


def pod_lists(api: KubeApiDouble) -> int:
    return sum(
        1 for r in api.calls("GET", "/api/v1/pods") if (r.query.get("watch") or [""])[0] != "1"
    )


def test_a_slow_first_list_is_not_abandoned_for_a_second_one(
    api: KubeApiDouble,
    extender_factory: Callable[..., RunningExtender],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for index in range(3):
        placed = pod(f"gpu-{index}", container("main", memory=4))
        placed["spec"]["nodeName"] = "node-a"
        placed["status"]["phase"] = "Running"
        api.add(placed)
    api.add(pod("cpu", container("main")))
    monkeypatch.setattr(podfeed, "START_LIST_SECONDS", 0.2)
    gc.unfreeze()
    api.hold()  # the list takes longer than the extender waits
    try:
        server = extender_factory(api_server=api.url, token_file="", ca_file="", watch_nodes=False)
        assert get(server, "/readyz")[0] == 503
        assert gc.get_freeze_count() == 0  # nothing settled before the list is read
    finally:
        api.release()
    try:
        eventually(lambda: get(server, "/readyz")[0] == 200)
        assert pod_lists(api) == 1
        assert server.ledger.live_pods == 3  # the GPU pods only
        # what the start built is frozen once the late list is in (server.settle_heap)
        eventually(lambda: gc.get_freeze_count() > 0)
    finally:
        gc.unfreeze()


container_st = st.fixed_dictionaries(
    {
        "name": st.just("c"),
        "resources": st.fixed_dictionaries(
            {},
            optional={
                "limits": st.dictionaries(
                    st.sampled_from(["cpu", MEMORY, CORE, f"{PREFIX}/other", "nvidia.com/gpu"]),
                    st.sampled_from(["0", "1", "4", "x", ""]),
                    max_size=3,
                ),
                "requests": st.dictionaries(
                    st.sampled_from(["cpu", MEMORY, CORE]), st.sampled_from(["0", "2"]), max_size=2
                ),
            },
        ),
    }
)
pod_st = st.fixed_dictionaries(
    {
        "metadata": st.fixed_dictionaries(
            {"name": st.just("p"), "uid": st.sampled_from(["u", ""])}
        ),
        "spec": st.fixed_dictionaries(
            {"containers": st.lists(container_st, max_size=3)},
            optional={"initContainers": st.lists(container_st, max_size=2)},
        ),
        "status": st.fixed_dictionaries(
            {"phase": st.sampled_from(["Pending", "Running", "Succeeded", "Failed"])}
        ),
    }
)


@given(pod_st)
def test_the_quick_skip_drops_only_pods_the_list_would_drop(the_pod: dict[str, Any]) -> None:
    """Every pod the full reading keeps passes the cheap test first."""
    facts = podfeed.facts_of(the_pod, PREFIX)
    if facts.uid and (facts.need is not None or facts.ended):
        assert podfeed._may_matter(the_pod, PREFIX)
