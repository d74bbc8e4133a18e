"""After a kubelet restart, who held units before counts until the records list it
again (issue 32.14): the pure part, the node state and the extender."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from kit.extender import PREFIX, args, card, container, pod

from gpushare.extender.ledger import AdmissionLedger
from gpushare.extender.verbs import ExtenderPolicy, ExtenderState, filter_verb
from gpushare.kube import nodestate
from gpushare.share.devices import Resource
from gpushare.share.restartholders import (
    LONGEST_SECONDS,
    RECENT_SECONDS,
    RestartHolders,
)
from gpushare.share.usage import Holder

A = Holder("ml", "a", "main")
B = Holder("ml", "b", "main")
MEM_ONLY = {Resource.MEMORY: 12}
BOTH = {Resource.MEMORY: 4, Resource.CORE: 50}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _holders(clock: Clock) -> RestartHolders:
    return RestartHolders(clock, wall=lambda: 1_795_000_000.0)


def test_a_holder_unlisted_after_the_restart_still_holds_its_units_until_listed() -> None:
    clock = Clock()
    changes: list[str] = []
    holders = _holders(clock)
    holders.listeners.append(lambda: changes.append(holders.restarted_at()))
    holders.records_read({"GPU-0": {A: MEM_ONLY}, "GPU-1": {B: BOTH}}, kubelet=1)
    assert holders.held(Resource.MEMORY) == {} and holders.restarted_at() == ""
    holders.kubelet_restarted()
    assert holders.held(Resource.MEMORY) == {"GPU-0": 12, "GPU-1": 4}
    assert holders.held(Resource.CORE) == {"GPU-1": 50}
    assert holders.restarted_at().endswith("Z") and changes == [holders.restarted_at()]
    holders.records_read({"GPU-1": {B: BOTH}}, kubelet=2)  # the first batch: B only
    assert holders.held(Resource.MEMORY) == {"GPU-0": 12} and holders.waiting_for() == 1
    holders.records_read({"GPU-0": {A: MEM_ONLY}, "GPU-1": {B: BOTH}}, kubelet=2)
    assert holders.held(Resource.MEMORY) == {} and holders.restarted_at() == ""
    assert changes[-1] == ""  # told when complete


def test_a_new_kubelets_records_read_before_the_restart_is_reported_do_not_count() -> None:
    clock = Clock()
    holders = _holders(clock)
    holders.records_read({"GPU-0": {A: MEM_ONLY}}, kubelet=1)
    holders.records_read({}, kubelet=2)  # the restarted kubelet lists nobody yet
    holders.kubelet_restarted()
    assert holders.held(Resource.MEMORY) == {"GPU-0": 12}


def test_empty_records_read_just_before_the_restart_is_noticed_do_not_count() -> None:
    # the restarted kubelet answers PodResources before its new socket is noticed
    clock = Clock()
    holders = _holders(clock)
    holders.records_read({"GPU-0": {A: MEM_ONLY}}, kubelet=1)
    clock.now += 1
    holders.records_read({}, kubelet=1)
    holders.kubelet_restarted()
    assert holders.held(Resource.MEMORY) == {"GPU-0": 12}
    # a holder gone from the records long before the restart is not expected
    later = _holders(clock)
    later.records_read({"GPU-0": {A: MEM_ONLY}}, kubelet=1)
    clock.now += RECENT_SECONDS + 1
    later.records_read({}, kubelet=1)
    later.kubelet_restarted()
    assert later.held(Resource.MEMORY) == {} and later.restarted_at() == ""


def test_a_deleted_pod_stops_holding_as_soon_as_it_is_known_gone() -> None:
    clock = Clock()
    holders = _holders(clock)
    holders.records_read({"GPU-0": {A: MEM_ONLY}}, kubelet=1)
    holders.kubelet_restarted()
    holders.records_read({}, alive=lambda h: True, kubelet=2)
    assert holders.held(Resource.MEMORY) == {"GPU-0": 12}  # alive, not listed yet
    holders.records_read({}, alive=lambda h: False, kubelet=2)
    assert holders.held(Resource.MEMORY) == {} and holders.restarted_at() == ""


def test_the_callers_fresher_records_and_deletions_are_not_counted_twice() -> None:
    """Issue 32.14 (a), seen on a real kubelet: the binder's own records, read after
    the last read fed here, list A again; counting A's units from them AND from here
    made every card look full. B's pod is being deleted: it holds nothing to place by."""
    holders = _holders(Clock())
    holders.records_read({"GPU-0": {A: MEM_ONLY}, "GPU-1": {B: BOTH}}, kubelet=1)
    holders.kubelet_restarted()
    assert holders.held(Resource.MEMORY) == {"GPU-0": 12, "GPU-1": 4}
    assert holders.held(Resource.MEMORY, listed={A}) == {"GPU-1": 4}
    assert holders.held(Resource.MEMORY, listed={A}, alive=lambda h: h != B) == {}
    assert holders.held(Resource.CORE, alive=lambda h: h != B) == {}
    assert holders.waiting_for() == 2  # held() never changes what is waited for


def test_a_holder_never_listed_again_is_given_up_after_the_longest_wait() -> None:
    clock = Clock()
    holders = _holders(clock)
    holders.records_read({"GPU-0": {A: MEM_ONLY}}, kubelet=1)
    holders.kubelet_restarted()
    assert holders.records_read({}, alive=lambda h: True, kubelet=2) == 0
    clock.now += LONGEST_SECONDS
    assert holders.records_read({}, alive=lambda h: True, kubelet=2) == 1
    assert holders.restarted_at() == ""


def test_a_restart_with_nothing_held_is_complete_at_once() -> None:
    holders = _holders(Clock())
    holders.records_read({}, kubelet=1)
    holders.kubelet_restarted()
    assert holders.restarted_at() == "" and holders.held(Resource.CORE) == {}


@given(
    before=st.dictionaries(
        st.sampled_from(["GPU-0", "GPU-1"]),
        st.dictionaries(
            st.sampled_from([A, B, Holder("x", "c", "main")]),
            st.fixed_dictionaries(
                {Resource.MEMORY: st.integers(0, 16), Resource.CORE: st.integers(0, 100)}
            ),
            max_size=3,
        ),
        max_size=2,
    ),
    listed_again=st.sets(st.sampled_from([A, B, Holder("x", "c", "main")])),
)
def test_held_counts_exactly_the_holders_not_listed_again(
    before: dict[str, dict[Holder, dict[Resource, int]]], listed_again: set[Holder]
) -> None:
    holders = _holders(Clock())
    holders.records_read(before, kubelet=1)
    holders.kubelet_restarted()
    after = {
        uuid: {h: u for h, u in hs.items() if h in listed_again} for uuid, hs in before.items()
    }
    holders.records_read(after, kubelet=2)
    for resource in Resource:
        expected = {
            uuid: total
            for uuid, hs in before.items()
            if (total := sum(u[resource] for h, u in hs.items() if h not in listed_again))
        }
        assert holders.held(resource) == expected
    missing = any(h not in listed_again for hs in before.values() for h in hs)
    assert (holders.restarted_at() != "") == missing


# -- the node state and the extender -------------------------------------------------


def _state(restarted: str) -> nodestate.NodeGpuState:
    return nodestate.NodeGpuState(3, "2026-11-27T05:00:00Z", 256, (card(0),), (), restarted)


def test_the_node_state_carries_the_restart_while_records_are_incomplete() -> None:
    state = _state("2026-11-27T05:00:00Z")
    assert nodestate.decode(nodestate.encode(state)) == state
    assert "kubeletRestarted" not in nodestate.encode(_state(""))
    text = nodestate.encode(state).replace("2026-11-27T05:00:00Z\"}", "x" * 41 + "\"}")
    try:
        nodestate.decode(text)
    except ValueError as exc:
        assert "kubeletRestarted" in str(exc)
    else:
        raise AssertionError("an over-long kubeletRestarted was accepted")


def test_the_extender_sends_no_pod_to_a_node_whose_kubelet_just_restarted() -> None:
    def node(restarted: str) -> dict[str, object]:
        return {
            "kind": "Node",
            "metadata": {
                "name": "gpu-0",
                "annotations": {
                    nodestate.annotation_key(PREFIX): nodestate.encode(_state(restarted))
                },
            },
        }

    state = ExtenderState(AdmissionLedger(60))
    policy = ExtenderPolicy(PREFIX)
    restarted = node("2026-11-27T05:00:00Z")
    answer = filter_verb(args(pod("p", container("main", 4)), restarted), policy, state)
    assert answer["Nodes"]["items"] == []
    reason = answer["FailedNodes"]["gpu-0"]
    assert "kubelet restarted at 2026-11-27T05:00:00Z" in reason and "retried" in reason
    answer = filter_verb(args(pod("q", container("main", 4)), node("")), policy, state)
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["gpu-0"]
