"""A filter call cannot plant a node state that outranks what the daemon publishes
(issue 32.15): a state dated ahead of the extender's clock, or at a generation its
daemon cannot have reached since the state seen before, is not believed; a forged
state that passes is replaced by the daemon's next publish."""

from __future__ import annotations

import calendar
import time
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from kit.extender import PREFIX, args, card, container, pod

from gpushare.extender.ledger import AdmissionLedger
from gpushare.extender.verbs import (
    MAX_CLOCK_SKEW_SECONDS,
    ExtenderPolicy,
    ExtenderState,
    filter_verb,
)
from gpushare.kube import nodestate

POLICY = ExtenderPolicy(PREFIX)
NOW = float(calendar.timegm(time.strptime("2026-11-27T05:00:00Z", "%Y-%m-%dT%H:%M:%SZ")))


def _stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _node(name: str, generation: int, updated: str, used: int) -> dict[str, Any]:
    state = nodestate.NodeGpuState(generation, updated, 256, (card(0, used),))
    return {
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {nodestate.annotation_key(PREFIX): nodestate.encode(state)},
        },
        "status": {"allocatable": {f"{PREFIX}/vcuda-memory": "16"}},
    }


def _kept(state: ExtenderState, name: str, *nodes: dict[str, Any]) -> list[str]:
    answer = filter_verb(args(pod(name, container("main", 4)), *nodes), POLICY, state)
    return [n["metadata"]["name"] for n in answer["Nodes"]["items"]]


def _state(clock: list[float]) -> ExtenderState:
    return ExtenderState(AdmissionLedger(60), clock=lambda: clock[0])


NAMES = [f"gpu-{i}" for i in range(10)]


def test_a_far_future_state_at_a_huge_generation_is_not_kept() -> None:
    clock = [NOW]
    state = _state(clock)
    real = [_node(n, 7, _stamp(NOW - 10), 0) for n in NAMES]
    assert _kept(state, "first", *real) == NAMES
    planted = [_node(n, 10**6, _stamp(NOW + 10 * 365 * 86400), 16) for n in NAMES]
    assert _kept(state, "planter", *planted) == NAMES  # not believed: what was seen stands
    clock[0] += 30
    later = [_node(n, 8, _stamp(NOW + 20), 0) for n in NAMES]
    assert _kept(state, "real", *later) == NAMES
    for n in NAMES:
        remembered = state.nodes.get(n)
        assert remembered is not None and remembered.generation == 8


def test_a_huge_generation_dated_now_is_not_believed_over_the_state_seen() -> None:
    clock = [NOW]
    state = _state(clock)
    assert _kept(state, "first", _node("gpu-0", 7, _stamp(NOW - 10), 0)) == ["gpu-0"]
    assert _kept(state, "planter", _node("gpu-0", 10**6, _stamp(NOW), 16)) == ["gpu-0"]
    remembered = state.nodes.get("gpu-0")
    assert remembered is not None and remembered.generation == 7
    # the daemon's own next state is believed
    assert _kept(state, "real", _node("gpu-0", 8, _stamp(NOW + 1), 0)) == ["gpu-0"]


def test_a_first_state_dated_far_ahead_is_refused_with_a_reason() -> None:
    state = _state([NOW])
    ahead = _stamp(NOW + MAX_CLOCK_SKEW_SECONDS + 60)
    answer = filter_verb(
        args(pod("p", container("main", 4)), _node("gpu-0", 3, ahead, 0)), POLICY, state
    )
    assert answer["Nodes"]["items"] == []
    assert "ahead of the extender's clock" in answer["FailedNodes"]["gpu-0"]
    assert state.nodes.get("gpu-0") is None


def test_a_forged_next_generation_is_replaced_by_the_daemons_next_publish() -> None:
    # The most a forger gets: a plausible state (next generation, dated now) holds until
    # the daemon publishes again (at least every 30 s, with a later timestamp).
    clock = [NOW]
    state = _state(clock)
    assert _kept(state, "first", _node("gpu-0", 7, _stamp(NOW - 10), 0)) == ["gpu-0"]
    assert _kept(state, "planter", _node("gpu-0", 8, _stamp(NOW), 16)) == []
    clock[0] += 30
    assert _kept(state, "real", _node("gpu-0", 8, _stamp(NOW + 30), 0)) == ["gpu-0"]


@given(
    generation=st.integers(8, 10**12),
    ahead=st.floats(0, 10**9, allow_nan=False),
    daemon_later=st.integers(1, 30),
)
def test_no_planted_state_outlives_the_daemons_next_publish(
    generation: int, ahead: float, daemon_later: int
) -> None:
    clock = [NOW]
    state = _state(clock)
    _kept(state, "first", _node("gpu-0", 7, _stamp(NOW - 5), 0))
    _kept(state, "planter", _node("gpu-0", generation, _stamp(NOW + ahead), 16))
    # the daemon's first publish dated after the planted state (or after the skew bound)
    later = min(ahead, MAX_CLOCK_SKEW_SECONDS) + daemon_later
    clock[0] += later
    real = _node("gpu-0", 8, _stamp(NOW + later), 0)
    assert _kept(state, "real", real) == ["gpu-0"]
