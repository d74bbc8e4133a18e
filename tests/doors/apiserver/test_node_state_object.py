"""The card state off the Node: the daemon's state object (ConfigMap
``gpushare-node-<node>``), written only when the state changes, read back and rewritten
only where it differs, in each ``--node-state`` mode; against the API-server double."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import NODE, TESLA_P4, Node, cards
from kit.kube_double import KubeApiDouble
from kit.procs import eventually

from gpushare.kube import apilink, nodestate, stateobject
from gpushare.kube.apilink import ApiLink

NAMESPACE = "gpushare-system"
OBJECT = f"gpushare-node-{NODE}"
WRITES = ("PATCH", "PUT", "POST", "DELETE")
#: generous: the machine running the suite may be loaded
WAIT = 60.0


@pytest.fixture(autouse=True)
def namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", NAMESPACE)


@pytest.fixture
def fast_resync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read back what was published every 20 ms (it is once a minute by default)."""
    monkeypatch.setattr(apilink, "RESYNC_SECONDS", 0.02)


def state_object(api: KubeApiDouble) -> dict[str, Any] | None:
    return api.get("ConfigMap", OBJECT, NAMESPACE)


def object_state(api: KubeApiDouble) -> nodestate.NodeGpuState | None:
    found = state_object(api)
    return nodestate.decode(found["data"]["gpus"]) if found else None


def annotation(api: KubeApiDouble) -> str | None:
    annotations = api.get("Node", NODE)["metadata"].get("annotations") or {}
    text = annotations.get(nodestate.annotation_key("gpushare.io"))
    return str(text) if text is not None else None


def link_of(node: Node) -> ApiLink:
    assert node.daemon is not None and node.daemon.core is not None
    link = node.daemon.core.api_link
    assert link is not None
    return link


def writes(api: KubeApiDouble) -> list[tuple[str, str]]:
    return [(r.method, r.path) for m in WRITES for r in api.calls(m)]


def test_the_state_object_is_owned_by_the_node_and_holds_what_the_annotation_holds(
    node: Node, api: KubeApiDouble
) -> None:
    node.start(cards(TESLA_P4, 2), node_name=NODE)
    found = eventually(lambda: state_object(api), timeout=WAIT)
    eventually(lambda: annotation(api), timeout=WAIT)  # mode "both": the Node too
    meta = found["metadata"]
    assert meta["labels"]["gpushare.io/node-state"] == "true"
    assert meta["annotations"]["gpushare.io/node"] == NODE
    uid = api.get("Node", NODE)["metadata"]["uid"]
    assert meta["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid}
    ]
    assert found["data"]["gpus"] == annotation(api)
    read = stateobject.read_state_object(found, "gpushare.io")
    assert (read.node, read.problem, read.owner_uid) == (NODE, "", uid)
    assert [c.memory_units for c in nodestate.decode(read.text or "").cards] == [29, 29]


def test_nothing_is_written_while_nothing_changes(
    node: Node, api: KubeApiDouble, fast_resync: None
) -> None:
    """The steady state: N read-backs find what was written, and write nothing."""
    node.start(cards(TESLA_P4, 2), node_name=NODE, pod_resources_interval_seconds=3600)
    link = link_of(node)
    eventually(lambda: state_object(api) and annotation(api), timeout=WAIT)
    start = link.publisher.resyncs
    eventually(lambda: link.publisher.resyncs >= start + 2, timeout=WAIT)  # settled
    before = writes(api)
    done = link.publisher.resyncs
    eventually(lambda: link.publisher.resyncs >= done + 20, timeout=WAIT)
    assert writes(api) == before
    assert link.publisher.writes == {"object": 1, "node": 1}
    # the read-backs were reads: GETs of the object and the Node
    assert len(api.calls("GET", f"/configmaps/{OBJECT}")) >= 20


def test_a_use_changes_the_state_once_per_place(node: Node, api: KubeApiDouble) -> None:
    node.start(cards(TESLA_P4, 2), node_name=NODE, pod_resources_interval_seconds=3600)
    link = link_of(node)
    # Both places hold the first state before the use: otherwise the Node's first write
    # may already carry the use (one Node write, two object writes), a race not a fault.
    eventually(lambda: state_object(api) and annotation(api), timeout=WAIT)
    node.kubelet.admit("a", "main", {node.memory: 5, node.core: 10})
    state = eventually(
        lambda: (s := object_state(api)) and sum(c.memory_units_used for c in s.cards) == 5 and s,
        timeout=WAIT,
    )
    assert state.generation >= 2
    eventually(lambda: annotation(api) == state_object(api)["data"]["gpus"], timeout=WAIT)
    assert link.publisher.writes["object"] == link.publisher.writes["node"]


@pytest.mark.parametrize("damage", ["deleted", "edited"])
def test_a_state_object_someone_else_changed_is_written_again(
    node: Node, api: KubeApiDouble, fast_resync: None, damage: str
) -> None:
    node.start(cards(TESLA_P4, 1), node_name=NODE, pod_resources_interval_seconds=3600)
    good = eventually(lambda: state_object(api), timeout=WAIT)["data"]["gpus"]
    if damage == "deleted":
        api.delete("ConfigMap", OBJECT, NAMESPACE)
    else:
        edited = state_object(api)
        assert edited is not None
        edited["data"]["gpus"] = good.replace('"memory_units_used":0', '"memory_units_used":29')
        assert edited["data"]["gpus"] != good
        api.add(edited)
    eventually(lambda: (found := state_object(api)) and found["data"]["gpus"] == good, timeout=WAIT)


def test_mode_object_writes_no_annotation_and_removes_an_old_one(
    node: Node, api: KubeApiDouble, fast_resync: None
) -> None:
    stale = api.get("Node", NODE)
    stale["metadata"]["annotations"] = {"gpushare.io/gpus": '{"version": 1}', "other/x": "y"}
    api.add(stale)
    node.start(
        cards(TESLA_P4, 2),
        node_name=NODE,
        node_state="object",
        pod_resources_interval_seconds=3600,
    )
    link = link_of(node)
    eventually(lambda: state_object(api), timeout=WAIT)
    eventually(lambda: annotation(api) is None, timeout=WAIT)
    shown = api.get("Node", NODE)["metadata"]
    assert shown["annotations"] == {"other/x": "y"}  # only its own annotation went
    assert shown["labels"]["gpushare.io/gpu.count"] == "2"  # labels stay on the Node
    node_writes = link.publisher.writes["node"]
    done = link.publisher.resyncs
    eventually(lambda: link.publisher.resyncs >= done + 10, timeout=WAIT)
    assert link.publisher.writes["node"] == node_writes == 1  # labels and removal at once
    # a label someone removed comes back at the next read-back
    bare = api.get("Node", NODE)
    del bare["metadata"]["labels"]["gpushare.io/gpu.count"]
    api.add(bare)
    eventually(
        lambda: api.get("Node", NODE)["metadata"]["labels"].get("gpushare.io/gpu.count") == "2",
        timeout=WAIT,
    )


def test_mode_annotation_writes_no_object(node: Node, api: KubeApiDouble) -> None:
    node.start(cards(TESLA_P4, 1), node_name=NODE, node_state="annotation")
    eventually(lambda: annotation(api), timeout=WAIT)
    assert state_object(api) is None
    # it only looks for an object of its own to retire (none here)
    asked = {(r.method, r.path) for r in api.requests if "/configmaps" in r.path}
    assert asked == {("GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/{OBJECT}")}


def test_leaving_mode_object_retires_the_object_and_continues_its_generation(
    node: Node, api: KubeApiDouble
) -> None:
    """Issue 41.3: a daemon switched to ``annotation`` left its object behind, which the
    extender believed for ever. Now it deletes its own object (by name, with the
    object's UID and version as preconditions) and its annotation passes the object's
    generation."""
    text = nodestate.encode(nodestate.NodeGpuState(41, "2026-11-27T05:00:00Z", 256, ()))
    uid = api.get("Node", NODE)["metadata"]["uid"]
    api.add(stateobject.state_object("gpushare.io", NAMESPACE, NODE, uid, text))
    other = stateobject.state_object("gpushare.io", NAMESPACE, "other-node", "u2", text)
    api.add(other)
    node.start(cards(TESLA_P4, 1), node_name=NODE, node_state="annotation")
    eventually(lambda: state_object(api) is None, timeout=WAIT)
    published = eventually(lambda: annotation(api), timeout=WAIT)
    assert nodestate.decode(published).generation == 42
    assert link_of(node).publisher.retired == 1
    own = f"/api/v1/namespaces/{NAMESPACE}/configmaps/{OBJECT}"
    assert [r.path for r in api.calls("DELETE")] == [own]
    assert api.get("ConfigMap", "gpushare-node-other-node", NAMESPACE) is not None


def test_an_object_that_cannot_be_retired_is_said_once_and_the_annotation_goes_on(
    node: Node, api: KubeApiDouble, fast_resync: None
) -> None:
    """Without the right to delete (an older Role): the annotation is published all the
    same, and the daemon does not ask again at every read-back."""
    text = nodestate.encode(nodestate.NodeGpuState(3, "2026-11-27T05:00:00Z", 256, ()))
    uid = api.get("Node", NODE)["metadata"]["uid"]
    api.add(stateobject.state_object("gpushare.io", NAMESPACE, NODE, uid, text))
    api.forbidden_paths.append("/configmaps")
    node.start(cards(TESLA_P4, 1), node_name=NODE, node_state="annotation")
    link = link_of(node)
    eventually(lambda: annotation(api), timeout=WAIT)
    done = link.publisher.resyncs
    eventually(lambda: link.publisher.resyncs >= done + 5, timeout=WAIT)
    assert len([r for r in api.requests if "/configmaps" in r.path]) == 1
    assert link.publisher.retired == 0


def test_the_generation_continues_from_the_state_object(node: Node, api: KubeApiDouble) -> None:
    """A restarted daemon in mode ``object`` continues from the object's generation (no
    annotation to read it from): readers never see the generation go back."""
    text = nodestate.encode(nodestate.NodeGpuState(41, "2026-11-27T05:00:00Z", 256, ()))
    uid = api.get("Node", NODE)["metadata"]["uid"]
    api.add(stateobject.state_object("gpushare.io", NAMESPACE, NODE, uid, text))
    node.start(cards(TESLA_P4, 1), node_name=NODE, node_state="object")
    state = eventually(
        lambda: (s := object_state(api)) and s.generation != 41 and s, timeout=WAIT
    )
    assert state.generation == 42


def test_a_daemon_upgraded_before_its_role_publishes_the_annotation_then_the_object(
    node: Node, api: KubeApiDouble, fast_resync: None
) -> None:
    """Mode both without RBAC for ConfigMaps (the image upgraded, the Role not yet): the
    annotation carries the state; once the Role is there, the next read-back writes the
    object. No flag day."""
    api.forbidden_paths.append("/configmaps")
    node.start(cards(TESLA_P4, 2), node_name=NODE, pod_resources_interval_seconds=3600)
    link = link_of(node)
    eventually(lambda: annotation(api), timeout=WAIT)
    assert link.publisher.object_forbidden
    assert state_object(api) is None
    api.forbidden_paths.clear()
    found = eventually(lambda: state_object(api), timeout=WAIT)
    assert found["data"]["gpus"] == annotation(api)
    assert not link.publisher.object_forbidden


def test_mode_object_without_its_role_keeps_retrying_and_never_writes_the_node_state(
    node: Node, api: KubeApiDouble
) -> None:
    api.forbidden_paths.append("/configmaps")
    node.start(cards(TESLA_P4, 1), node_name=NODE, node_state="object")
    eventually(lambda: len(api.calls("GET", "/configmaps/")) >= 2, timeout=WAIT)  # retried
    assert annotation(api) is None
    assert link_of(node).publishes == 0
