"""The extender reads each node's card state from its state object (ConfigMap
``gpushare-node-<node>``), falls back to the Node annotation per node (older daemons,
rollouts), and believes an object only when it is self-consistent and owned by the Node
it names; over real HTTP against the API-server double."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kit.extender import (
    PREFIX,
    RunningExtender,
    api,
    args,
    card,
    container,
    extender_factory,
    get,
    kept,
    node,
    pod,
)
from kit.kube_double import KubeApiDouble
from kit.procs import eventually

from gpushare.kube import nodestate, stateobject

__all__ = ["api", "extender_factory"]  # fixture

NAMESPACE = "gpushare"
WAIT = 60.0


def state_text(cards: list[nodestate.CardState], generation: int = 5) -> str:
    return nodestate.encode(
        nodestate.NodeGpuState(generation, "2026-11-22T13:00:00Z", 256, tuple(cards))
    )


def state_object(name: str, text: str, uid: str | None = None) -> dict[str, Any]:
    return stateobject.state_object(
        PREFIX, NAMESPACE, name, uid if uid is not None else f"uid-node-{name}", text
    )


def by_names(server: RunningExtender, memory: int, *names: str) -> dict[str, Any]:
    the_pod = pod("p", container("main", memory=memory))
    answer: dict[str, Any] = server.filter({"Pod": the_pod, "Nodes": None, "NodeNames": names})
    return answer


@pytest.fixture
def start(
    api: KubeApiDouble, extender_factory: Callable[..., RunningExtender]
) -> Callable[[], RunningExtender]:
    def run() -> RunningExtender:
        server = extender_factory(
            api_server=api.url, token_file="", ca_file="", state_namespace=NAMESPACE
        )
        eventually(lambda: get(server, "/readyz")[0] == 200, timeout=WAIT)
        return server

    return run


def test_the_object_wins_over_the_annotation_and_nodes_without_one_use_the_annotation(
    api: KubeApiDouble, start: Callable[[], RunningExtender]
) -> None:
    api.add(node("new", [card(0, used=16)]))  # the annotation says full ...
    api.add(state_object("new", state_text([card(0, used=0)])))  # ... the object free
    api.add(node("old", [card(0, used=4)]))  # an older daemon: annotation only
    only = node("object-only")  # mode "object": no annotation at all
    api.add(only)
    api.add(state_object("object-only", state_text([card(0, used=8)])))
    server = start()
    answer = by_names(server, 8, "new", "old", "object-only")
    assert answer["NodeNames"] == ["new", "old", "object-only"], answer["FailedNodes"]
    answer = by_names(server, 12, "new", "old", "object-only")
    assert answer["NodeNames"] == ["new", "old"]
    assert "object-only" in answer["FailedNodes"]


@pytest.mark.parametrize("annotation_is", ["a later generation", "later, counting again"])
def test_an_object_left_behind_loses_to_a_newer_annotation(
    api: KubeApiDouble, start: Callable[[], RunningExtender], annotation_is: str
) -> None:
    """Issue 41.3: the daemon went to ``nodeState: annotation`` and its object stayed,
    full; the annotation it writes now says the card is free. The newer of the two is
    believed: by generation, or by time where the daemon started counting again."""
    api.add(state_object("n", state_text([card(0, used=16)], generation=7)))
    fresh = node("n", [card(0, used=0)], generation=9)
    if annotation_is == "later, counting again":
        state = nodestate.NodeGpuState(1, "2026-11-22T14:00:00Z", 256, (card(0, used=0),))
        fresh["metadata"]["annotations"][nodestate.annotation_key(PREFIX)] = nodestate.encode(
            state
        )
    api.add(fresh)
    server = start()
    assert by_names(server, 8, "n")["NodeNames"] == ["n"]
    # and the other way round: an annotation older than the object loses
    api.add(state_object("n", state_text([card(0, used=16)], generation=12)))
    stale = node("n", [card(0, used=0)], generation=2)
    api.add(stale)
    eventually(lambda: by_names(server, 8, "n")["NodeNames"] == [], timeout=WAIT)


@pytest.mark.parametrize(
    "forged",
    ["owned by an earlier Node", "named for another node", "owned by no Node", "garbled"],
)
def test_an_object_not_believed_leaves_the_annotation_in_force(
    api: KubeApiDouble, start: Callable[[], RunningExtender], forged: str
) -> None:
    api.add(node("n", [card(0, used=16)]))  # the annotation: full
    bad = state_object("n", state_text([card(0, used=0)]))
    if forged == "owned by an earlier Node":
        bad["metadata"]["ownerReferences"][0]["uid"] = "uid-of-a-deleted-node"
    elif forged == "named for another node":
        bad["metadata"]["annotations"]["gpushare.io/node"] = "m"
    elif forged == "owned by no Node":
        bad["metadata"]["ownerReferences"] = []
    else:
        bad["data"]["gpus"] = '{"version": 1'
    api.add(bad)
    server = start()
    answer = by_names(server, 8, "n")
    assert answer["NodeNames"] == [], forged
    assert "no card" in answer["FailedNodes"]["n"] or "free" in answer["FailedNodes"]["n"]


def test_a_stale_object_of_a_node_without_annotation_says_why(
    api: KubeApiDouble, start: Callable[[], RunningExtender]
) -> None:
    api.add(node("n"))
    api.add(state_object("n", state_text([card(0)]), uid="uid-of-a-deleted-node"))
    server = start()
    answer = by_names(server, 1, "n")
    assert answer["NodeNames"] == []
    assert "earlier Node of that name" in answer["FailedNodes"]["n"]


def test_a_change_to_the_object_reaches_the_answers_through_the_watch(
    api: KubeApiDouble, start: Callable[[], RunningExtender]
) -> None:
    api.add(node("n"))
    api.add(state_object("n", state_text([card(0, used=16)], generation=5)))
    server = start()
    assert by_names(server, 8, "n")["NodeNames"] == []
    api.add(state_object("n", state_text([card(0, used=0)], generation=6)))
    eventually(lambda: by_names(server, 8, "n")["NodeNames"] == ["n"], timeout=WAIT)
    api.delete("ConfigMap", "gpushare-node-n", NAMESPACE)
    answer = eventually(
        lambda: (a := by_names(server, 8, "n"))["NodeNames"] == [] and a, timeout=WAIT
    )
    assert "neither a state object nor" in answer["FailedNodes"]["n"]


def test_full_node_requests_are_judged_by_the_object_not_the_annotation_they_carry(
    api: KubeApiDouble, start: Callable[[], RunningExtender]
) -> None:
    api.add(node("n", [card(0, used=16)]))
    api.add(state_object("n", state_text([card(0, used=0)], generation=9)))
    server = start()
    the_pod = pod("p", container("main", memory=8))
    # the request carries the Node with its (full) annotation: the object decides
    assert kept(server.filter(args(the_pod, node("n", [card(0, used=16)])))) == ["n"]


def test_objects_of_other_namespaces_are_not_read_and_the_list_selects_by_label(
    api: KubeApiDouble, start: Callable[[], RunningExtender]
) -> None:
    api.add(node("n", [card(0, used=16)]))
    elsewhere = state_object("n", state_text([card(0)]))
    elsewhere["metadata"]["namespace"] = "other"
    api.add(elsewhere)
    server = start()
    assert by_names(server, 8, "n")["NodeNames"] == []
    lists = [r for r in api.requests if r.path.endswith("/configmaps")]
    assert lists and all(r.path == f"/api/v1/namespaces/{NAMESPACE}/configmaps" for r in lists)
    assert all(r.query.get("labelSelector") == ["gpushare.io/node-state=true"] for r in lists)
