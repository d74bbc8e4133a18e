"""gpushare.extender.nodecache: what the extender believes of a node: its state object
when that is consistent and owned by the Node it knows, else the Node's annotation; a
node with gpushare resources but nothing published is told apart from a node without
GPUs, and an unreadable annotation or object is a reason, never a crash."""

from __future__ import annotations

from typing import Any

from kit.extender import PREFIX, card, node

from gpushare.extender.nodecache import (
    NodeCache,
    NodeRecord,
    node_name,
    read_node_state,
    record_of,
    state_record_of,
)
from gpushare.kube import nodestate, stateobject


def state_object(name: str, owner_uid: str, used: int = 0) -> dict[str, Any]:
    """A state object published after the nodes' annotations (13:00): the newer of the
    two places is believed."""
    text = nodestate.encode(
        nodestate.NodeGpuState(3, "2026-11-22T13:05:00Z", 256, (card(0, used),))
    )
    return stateobject.state_object(PREFIX, "kube-system", name, owner_uid, text)


def test_a_nodes_annotation_is_read_once_with_its_rooms_and_uid() -> None:
    record = record_of(node("gpu-a", [card(0, used=4)]), PREFIX)
    assert record.code == "fits" and record.uid == "uid-node-gpu-a"
    assert record.state is not None and record.state.cards[0].memory_units_used == 4
    ((room),) = record.rooms
    assert room.memory_free == 16 - 4


def test_a_node_with_resources_but_nothing_published_is_not_a_node_without_gpus() -> None:
    daemon_node = node("gpu-a")  # the daemon's label, no annotation
    assert read_node_state(daemon_node, PREFIX)[1] == "no_annotation"
    plain = {"metadata": {"name": "cpu-1"}, "status": {"allocatable": {"cpu": "4"}}}
    assert read_node_state(plain, PREFIX)[:2] == (None, "no_gpus")
    with_units = {
        "metadata": {"name": "x"},
        "status": {"capacity": {f"{PREFIX}/vcuda-core": "100"}},
    }
    assert read_node_state(with_units, PREFIX)[1] == "no_annotation"
    bad = node("gpu-b")
    bad["metadata"]["annotations"][nodestate.annotation_key(PREFIX)] = "[[[["
    state, code, reason = read_node_state(bad, PREFIX)
    assert (state, code) == (None, "bad_annotation") and "cannot be read" in reason


def test_an_object_wins_over_the_annotation_only_when_its_owner_is_the_known_node() -> None:
    cache = NodeCache(expect_objects=True)
    assert not cache.listed
    cache.replace_all({"gpu-a": record_of(node("gpu-a", [card(0, used=1)]), PREFIX)})
    assert not cache.listed  # the objects are not listed yet
    cache.replace_objects(
        {"gpu-a": state_record_of(state_object("gpu-a", "uid-node-gpu-a", 9), PREFIX)}
    )
    assert cache.listed and len(cache) == 1
    got = cache.get("gpu-a")
    assert got is not None and got.state is not None and got.state.cards[0].memory_units_used == 9
    # an object left by an earlier Node of that name: the annotation is served instead
    cache.put_object(state_record_of(state_object("gpu-a", "uid-old", 9), PREFIX))
    got = cache.get("gpu-a")
    assert got is not None and got.state is not None and got.state.cards[0].memory_units_used == 1
    # ... and with no annotation either, the node waits for its daemon
    cache.put("gpu-a", NodeRecord(None, "no_annotation", "", uid="uid-node-gpu-a"))
    got = cache.get("gpu-a")
    assert got is not None and got.code == "stale_state"
    cache.drop_object("gpu-a", "someone-else")  # another object's deletion: kept
    assert "gpu-a" in cache.objects
    cache.drop_object("gpu-a", stateobject.object_name("gpu-a"))
    assert cache.get("gpu-a") == cache.records["gpu-a"]


def test_an_inconsistent_object_is_a_reason_and_the_annotation_is_served() -> None:
    obj = state_object("gpu-a", "uid-node-gpu-a")
    obj["metadata"]["annotations"][stateobject.node_annotation(PREFIX)] = "gpu-b"
    held = state_record_of(obj, PREFIX)
    assert held.record.state is None and held.record.code == "bad_state_object"
    cache = NodeCache()
    cache.replace_all({"gpu-a": record_of(node("gpu-a", [card(0)]), PREFIX)})
    cache.put_object(held)
    assert held.node == "gpu-a" and cache.get("gpu-a") == cache.records["gpu-a"]
    assert cache.objects_listed is False
    cache.objects_unreadable()  # no RBAC for the objects: the annotations are served
    assert cache.objects_listed is True


def test_a_name_is_read_only_from_a_mapping() -> None:
    assert node_name(node("gpu-a")) == "gpu-a"
    assert node_name({"metadata": "x"}) == "" and node_name({}) == ""
