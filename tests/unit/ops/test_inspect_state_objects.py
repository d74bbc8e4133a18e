"""``kubectl gpushare inspect`` reads a node's state object (ConfigMap
``gpushare-node-<node>``) before its Node annotation, and believes it only when it names
and is owned by that Node, and is the only one for it; and ``main`` lists them over real
HTTP (against the API-server double), falling back to annotations where it may not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kit.kube_double import KubeApiDouble
from test_inspect import P4, _card, _node

from gpushare.kube import nodestate, stateobject
from gpushare.kube.kubectlapi import Cluster
from gpushare.ops.inspect import build_view, fetch_state_objects, main

PREFIX = "gpushare.io"


def _with_uid(node: dict[str, Any]) -> dict[str, Any]:
    node["metadata"]["uid"] = f"uid-{node['metadata']['name']}"
    return node


def _object(node: str, used: int, generation: int, **meta: Any) -> dict[str, Any]:
    state = nodestate.NodeGpuState(
        generation, "2026-11-27T08:00:00Z", 256, (_card(0, P4, used, 0),)
    )
    obj = stateobject.state_object(
        PREFIX, "kube-system", node, f"uid-{node}", nodestate.encode(state)
    )
    obj["metadata"].update(meta)
    return obj


def _used(view: Any, node: str) -> tuple[int | None, int]:
    (shown,) = [n for n in view.nodes if n.name == node]
    return shown.generation, sum(c.card.memory_units_used for c in shown.cards)


def test_the_object_wins_and_a_node_without_one_shows_its_annotation() -> None:
    nodes = [
        _with_uid(_node("gpu-a", [_card(0, P4, 4, 0)], 3)),
        _with_uid(_node("gpu-b", [_card(0, P4, 2, 0)], 5)),
        _with_uid(_node("gpu-c", None, 0)),  # mode "object": no annotation
    ]
    objects = [_object("gpu-a", 20, 9), _object("gpu-c", 7, 2)]
    view = build_view(nodes, [], PREFIX, objects=objects)
    assert _used(view, "gpu-a") == (9, 20)
    assert _used(view, "gpu-b") == (5, 2)
    assert _used(view, "gpu-c") == (2, 7)


def test_an_object_older_than_the_annotation_is_not_shown() -> None:
    """An object left behind by a daemon switched to ``--node-state annotation``: the
    newer annotation is shown, as the extender believes it (an object as new or newer
    still wins, above)."""
    nodes = [_with_uid(_node("gpu-a", [_card(0, P4, 4, 0)], 12))]  # 2026-11-22T13:00:00Z
    left = nodestate.NodeGpuState(9, "2026-11-20T08:00:00Z", 256, (_card(0, P4, 20, 0),))
    obj = stateobject.state_object(
        PREFIX, "kube-system", "gpu-a", "uid-gpu-a", nodestate.encode(left)
    )
    view = build_view(nodes, [], PREFIX, objects=[obj])
    assert _used(view, "gpu-a") == (12, 4)


@pytest.mark.parametrize("forged", ["another owner", "another node", "a second one"])
def test_an_object_not_believed_leaves_the_annotation(forged: str) -> None:
    nodes = [_with_uid(_node("gpu-a", [_card(0, P4, 4, 0)], 3))]
    bad = _object("gpu-a", 20, 9)
    objects = [bad]
    if forged == "another owner":
        bad["metadata"]["ownerReferences"][0]["uid"] = "uid-someone"
    elif forged == "another node":
        bad["metadata"]["annotations"][stateobject.node_annotation(PREFIX)] = "gpu-b"
    else:
        objects.append(_object("gpu-a", 1, 10, namespace="tenant"))
    view = build_view(nodes, [], PREFIX, objects=objects)
    assert _used(view, "gpu-a") == (3, 4)


def test_main_lists_the_objects_of_every_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    api = KubeApiDouble()
    api.start()
    try:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        node = api.add(_node("gpu-a", [_card(0, P4, 4, 0)], 3))
        obj = _object("gpu-a", 20, 9)
        obj["metadata"]["ownerReferences"][0]["uid"] = node["metadata"]["uid"]
        api.add(obj)
        assert main(["-o", "json"]) == 0
        shown = json.loads(capsys.readouterr().out)["nodes"][0]
        assert shown["generation"] == 9
        (listed,) = [r for r in api.requests if r.path == "/api/v1/configmaps"]
        assert listed.query["labelSelector"] == ["gpushare.io/node-state=true"]
        # refused (no RBAC for ConfigMaps): none, and the annotations are shown
        api.fail_next(1, 403)
        assert fetch_state_objects(Cluster(), PREFIX) == []
    finally:
        api.stop()
