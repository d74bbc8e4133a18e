"""gpushare.kube.statepublish: a node's card state is written where the mode says (the
state object owned by the Node, the Node's annotation, or both) with the labels; the
next generation starts past what either place shows; a resync rewrites only what
someone changed; mode ``object`` removes an annotation an older daemon left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import NODE

from gpushare.kube import nodestate, stateobject
from gpushare.kube.statepublish import StatePublisher
from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint
from gpushare.sim.apidouble import KubeApiDouble

PREFIX, NAMESPACE = "example.com", "kube-system"
LABELS = {f"{PREFIX}/gpu.count": "1"}


def text(generation: int) -> str:
    return nodestate.encode(nodestate.NodeGpuState(generation, "", 256, ()))


def publisher(mode: str) -> StatePublisher:
    client = ApiClient(kubeconfig_endpoint(Path(os.environ["KUBECONFIG"])))
    return StatePublisher(lambda: client, NODE, PREFIX, NAMESPACE, mode)


def annotation(api: KubeApiDouble) -> str | None:
    node = api.get("Node", NODE)
    assert node is not None
    return (node["metadata"].get("annotations") or {}).get(nodestate.annotation_key(PREFIX))


def held(api: KubeApiDouble) -> str | None:
    obj = api.get("ConfigMap", stateobject.object_name(NODE), NAMESPACE)
    return None if obj is None else stateobject.read_state_object(obj, PREFIX).text


def test_both_places_are_written_and_the_object_is_owned_by_the_node(api: KubeApiDouble) -> None:
    states = publisher("both")
    assert states.connect() == 0  # nothing published before
    states.publish(text(1), LABELS)
    assert held(api) == text(1) == annotation(api)
    obj = api.get("ConfigMap", stateobject.object_name(NODE), NAMESPACE)
    assert obj is not None
    (owner,) = obj["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("Node", NODE)
    node = api.get("Node", NODE)
    assert node is not None and node["metadata"]["labels"][f"{PREFIX}/gpu.count"] == "1"
    states.publish(text(2), LABELS)
    assert states.writes == {"object": 2, "node": 2} and held(api) == text(2)
    assert publisher("both").connect() == 2  # a restarted daemon starts past it


def test_a_resync_rewrites_only_what_was_changed(api: KubeApiDouble) -> None:
    states = publisher("both")
    states.connect()
    states.publish(text(4), LABELS)
    assert states.resync(LABELS) is False  # as written: nothing to do
    api.delete("ConfigMap", stateobject.object_name(NODE), NAMESPACE)
    assert states.resync(LABELS) is True and held(api) == text(4)
    assert states.writes["object"] == 2 and states.writes["node"] == 1


def test_mode_object_removes_an_older_daemons_annotation(api: KubeApiDouble) -> None:
    publisher("annotation").publish(text(7), LABELS)
    assert annotation(api) == text(7) and held(api) is None
    states = publisher("object")
    assert states.connect() == 7
    states.publish(text(8), LABELS)
    assert held(api) == text(8) and annotation(api) is None


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="node state mode"):
        StatePublisher(lambda: None, NODE, PREFIX, NAMESPACE, "configmap")
