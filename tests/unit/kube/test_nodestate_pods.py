"""The pods a node's published state lists, and the extender's plan annotation, as
hostile input: bounded, validated, one clear error (or no plan), nothing else affected."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.kube import nodestate


def _state(pods: object, **extra: object) -> str:
    card = {
        "uuid": "GPU-a",
        "index": 0,
        "name": "T",
        "memory_mib": 4096,
        "memory_units": 16,
        "memory_units_used": 4,
        "core_units": 100,
        "core_units_used": 0,
        "healthy": True,
        "pods": pods,
        **extra,
    }
    return json.dumps(
        {"version": 1, "generation": 1, "updated": "", "memoryUnitMiB": 256, "gpus": [card]}
    )


def test_listed_pods_round_trip_and_an_older_daemon_lists_none() -> None:
    card = nodestate.CardState(
        "GPU-a", 0, "T", 4096, 16, 4, 100, 0, True, pods=(("uid-1", 4, 0),), pods_truncated=True
    )
    state = nodestate.NodeGpuState(3, "", 256, (card,))
    assert nodestate.decode(nodestate.encode(state)) == state
    older = json.loads(_state({}))
    del older["gpus"][0]["pods"]
    assert nodestate.decode(json.dumps(older)).cards[0].pods is None


@pytest.mark.parametrize(
    ("pods", "error"),
    [
        ([["uid", 1, 0]], "'pods' must be an object"),
        ({f"uid-{i}": [1, 0] for i in range(65)}, "more than 64 pods listed"),
        ({"x" * 321: [1, 0]}, "a pod key must have 1 to 320 characters"),
        ({"": [1, 0]}, "a pod key must have 1 to 320 characters"),
        ({"uid": [1]}, "pod units must be [memory, core]"),
        ({"uid": [True, 0]}, "pod units must be [memory, core]"),
        ({"uid": [-1, 0]}, "pod units must be [memory, core]"),
        ({"uid": [1, 2**40]}, "pod units must be [memory, core]"),
        ({"uid": "4,0"}, "pod units must be [memory, core]"),
    ],
)
def test_a_malformed_pod_list_makes_the_annotation_unreadable(pods: object, error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        nodestate.decode(_state(pods))


def test_the_plan_round_trips_and_anything_malformed_is_no_plan() -> None:
    plan = {"main": "GPU-a", "sidecar": "GPU-b"}
    assert nodestate.decode_plan(nodestate.encode_plan(plan)) == plan
    for bad in (
        None,
        7,
        "not json",
        "[1, 2]",
        '{"main": 3}',
        '{"": "GPU-a"}',
        json.dumps({"main": "x" * 254}),
        json.dumps({f"c{i}": "GPU-a" for i in range(65)}),
        "[" * 10_000,
        "x" * 100_000,
    ):
        assert nodestate.decode_plan(bad) == {}


@given(st.text(max_size=200))
def test_any_plan_text_reads_as_a_bounded_plan_or_none(text: str) -> None:
    plan = nodestate.decode_plan(text)
    assert len(plan) <= nodestate.MAX_PLAN_ENTRIES
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items())
