"""The bind verb: a pod holds room only on the node it was bound to.

A scheduler stand-in drives the real extender over HTTP as kube-scheduler does
(filter, prioritize, pick the best score, bind), the extender posts each Binding to
the API-server test double, and the double's pods say where each pod went.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kit.extender import (
    MEMORY,
    RunningExtender,
    api,
    args,
    card,
    container,
    extender_factory,
    kept,
    node,
    pod,
)
from kit.kube_double import KubeApiDouble

__all__ = ["api", "extender_factory"]  # fixture


@pytest.fixture
def binder(api: KubeApiDouble, extender_factory: Callable[..., RunningExtender]) -> RunningExtender:
    """The extender, binding through the double (no token: the double takes none). The
    tests hand it the Nodes in the requests (``nodeCacheCapable: false``), not through the
    double, so it runs without a node watch (which it would believe over the requests)."""
    return extender_factory(api_server=api.url, token_file="", ca_file="", watch_nodes=False)


def stored_pod(api: KubeApiDouble, name: str, memory: int, uid: str = "") -> dict[str, Any]:
    the_pod = pod(name, container("main", memory=memory))
    the_pod["metadata"]["uid"] = uid or the_pod["metadata"]["uid"]
    return api.add(the_pod)


def bind_args(the_pod: dict[str, Any], node_name: str) -> dict[str, Any]:
    meta = the_pod["metadata"]
    return {
        "PodName": meta["name"],
        "PodNamespace": meta["namespace"],
        "PodUID": meta["uid"],
        "Node": node_name,
    }


class SchedulerStandIn:
    """kube-scheduler's loop as far as the extender sees it. Its binding cycle runs
    after the next pod's scheduling cycle (``lag`` pods behind), as the real one's
    asynchronous binding can; a refused binding sends the pod back to the queue."""

    def __init__(self, server: RunningExtender, api: KubeApiDouble, nodes: list[Any]) -> None:
        self.server, self.api, self.nodes = server, api, nodes
        self.reasons: dict[str, dict[str, str]] = {}

    def _choose(self, the_pod: dict[str, Any]) -> str | None:
        answer = self.server.filter(args(the_pod, *self.nodes))
        self.reasons[the_pod["metadata"]["name"]] = answer["FailedNodes"]
        feasible = [n for n in self.nodes if n["metadata"]["name"] in kept(answer)]
        if not feasible:
            return None
        status, scores = self.server.post("prioritize", args(the_pod, *feasible))
        assert status == 200
        best = max(scores, key=lambda s: (s["Score"], [-ord(c) for c in s["Host"]]))
        return str(best["Host"])

    def run(self, names: list[str], lag: int = 1, rounds: int = 10) -> list[str]:
        """Schedule until every pod is bound or a round binds none; the unbound names."""
        queue = list(names)
        for _ in range(rounds):
            waiting: list[tuple[dict[str, Any], str]] = []
            retry: list[str] = []
            bound_any = False
            for name in queue:
                the_pod = self.api.get("Pod", name, "default")
                assert the_pod is not None
                chosen = self._choose(the_pod)
                if chosen is None:
                    retry.append(name)
                else:
                    waiting.append((the_pod, chosen))
                while len(waiting) > lag:
                    bound_any |= self._bind(*waiting.pop(0), retry)
            for item in waiting:
                bound_any |= self._bind(*item, retry)
            queue = retry
            if not queue or not bound_any:
                break
        return queue

    def _bind(self, the_pod: dict[str, Any], chosen: str, retry: list[str]) -> bool:
        status, answer = self.server.post("bind", bind_args(the_pod, chosen))
        assert status == 200
        if answer["Error"]:
            retry.append(the_pod["metadata"]["name"])
            return False
        return True


def units_per_node(api: KubeApiDouble, names: list[str]) -> dict[str, int]:
    use: dict[str, int] = {}
    for name in names:
        the_pod = api.get("Pod", name, "default")
        assert the_pod is not None
        where = the_pod["spec"].get("nodeName")
        if where:
            limits = the_pod["spec"]["containers"][0]["resources"]["limits"]
            use[where] = use.get(where, 0) + int(limits[MEMORY])
    return use


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_40_pods_of_16_units_all_bind_on_20_single_card_nodes_of_64(
    binder: RunningExtender, api: KubeApiDouble, lag: int
) -> None:
    nodes = [node(f"n{i:02d}", [card(0, memory_mib=64 * 256)]) for i in range(20)]
    names = [f"p{i:02d}" for i in range(40)]
    for name in names:
        stored_pod(api, name, 16)
    unbound = SchedulerStandIn(binder, api, nodes).run(names, lag=lag)
    assert unbound == []
    use = units_per_node(api, names)
    assert sum(use.values()) == 40 * 16
    assert max(use.values()) <= 64  # no card overcommitted
    assert len(api.calls("POST", "/binding")) >= 40


def test_a_burst_binds_only_what_the_cards_hold_and_says_why_the_rest_wait(
    binder: RunningExtender, api: KubeApiDouble
) -> None:
    burst = node("burst", [card(0), card(1)], generation=5)  # two empty 16-unit cards
    names = [f"burst-{i}" for i in range(10)]
    for name in names:
        stored_pod(api, name, 6)
    scheduler = SchedulerStandIn(binder, api, [burst])
    unbound = scheduler.run(names, lag=2)
    assert len(unbound) == 6  # two per card: 2 x 6 <= 16 < 3 x 6
    assert units_per_node(api, names) == {"burst": 24}
    assert scheduler.reasons[unbound[-1]]["burst"] == (
        "no single card has 6 free units: GPU0 4, GPU1 4 (counting 4 pod(s) bound here "
        "that the node's annotation does not show yet)"
    )
    assert len(binder.ledger) == 4
    # The daemon publishes the four pods: the holds give way to the annotation.
    published = node("burst", [card(0, 12), card(1, 12)], generation=6)
    answer = binder.filter(args(pod("burst-late", container("main", memory=6)), published))
    assert answer["FailedNodes"] == {"burst": "no single card has 6 free units: GPU0 4, GPU1 4"}
    assert len(binder.ledger) == 0


def test_a_filter_alone_holds_nothing_anywhere(binder: RunningExtender) -> None:
    """Ledger poisoning: a forged filter for a fake pod used to close every node."""
    nodes = [node(f"n{i}", [card(0, 15)]) for i in range(10)]  # 1 free unit each
    forged = pod("forged", container("main", memory=1))
    assert len(kept(binder.filter(args(forged, *nodes)))) == 10
    real = pod("real", container("main", memory=1))
    assert len(kept(binder.filter(args(real, *nodes)))) == 10
    assert len(binder.ledger) == 0


def test_a_forged_bind_for_a_pod_that_does_not_exist_holds_nothing(
    binder: RunningExtender, api: KubeApiDouble
) -> None:
    nodes = [node("n0", [card(0, 15)])]
    forged = pod("forged", container("main", memory=1))
    binder.filter(args(forged, *nodes))
    status, answer = binder.post("bind", bind_args(forged, "n0"))
    assert status == 200
    assert 'pods "forged" not found' in answer["Error"]
    assert len(binder.ledger) == 0
    # A bind for a pod the extender never filtered is refused before any API call.
    never = pod("never", container("main", memory=1))
    status, answer = binder.post("bind", bind_args(never, "n0"))
    assert "was not filtered by this extender" in answer["Error"]
    assert [c.path for c in api.calls("POST")] == ["/api/v1/namespaces/default/pods/forged/binding"]
    real = stored_pod(api, "real", 1)
    assert kept(binder.filter(args(real, *nodes))) == ["n0"]


def test_a_pod_deleted_or_recreated_before_binding_holds_nothing(
    binder: RunningExtender, api: KubeApiDouble
) -> None:
    nodes = [node("n0", [card(0, 8)])]  # 8 free units
    gone = stored_pod(api, "gone", 8)
    assert kept(binder.filter(args(gone, *nodes))) == ["n0"]
    api.delete("Pod", "gone", "default")
    _, answer = binder.post("bind", bind_args(gone, "n0"))
    assert "not found" in answer["Error"] and len(binder.ledger) == 0

    old = stored_pod(api, "same-name", 8)
    assert kept(binder.filter(args(old, *nodes))) == ["n0"]
    api.delete("Pod", "same-name", "default")
    new = stored_pod(api, "same-name", 8, uid="uid-same-name-2")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    _, answer = binder.post("bind", bind_args(old, "n0"))
    assert "409" in answer["Error"] and len(binder.ledger) == 0
    the_pod = api.get("Pod", "same-name", "default")
    assert the_pod is not None and "nodeName" not in the_pod["spec"]
    # The room is still there for the new pod.
    assert kept(binder.filter(args(new, *nodes))) == ["n0"]
    _, answer = binder.post("bind", bind_args(new, "n0"))
    assert answer == {"Error": ""}
    the_pod = api.get("Pod", "same-name", "default")
    assert the_pod is not None and the_pod["spec"]["nodeName"] == "n0"
    binding = api.calls("POST", "/binding")[-1].body
    assert binding["metadata"]["uid"] == new["metadata"]["uid"]
    assert binding["target"] == {"apiVersion": "v1", "kind": "Node", "name": "n0"}


def test_a_bind_that_no_longer_fits_is_refused_and_makes_no_api_call(
    binder: RunningExtender, api: KubeApiDouble
) -> None:
    nodes = [node("n0", [card(0, 8)])]
    first, second = stored_pod(api, "first", 8), stored_pod(api, "second", 8)
    assert kept(binder.filter(args(first, *nodes))) == ["n0"]
    assert kept(binder.filter(args(second, *nodes))) == ["n0"]  # before first is bound
    assert binder.post("bind", bind_args(first, "n0"))[1] == {"Error": ""}
    _, answer = binder.post("bind", bind_args(second, "n0"))
    assert answer["Error"].startswith("node n0 no longer holds pod default/second: ")
    assert len(api.calls("POST", "/binding")) == 1
    the_pod = api.get("Pod", "second", "default")
    assert the_pod is not None and "nodeName" not in the_pod["spec"]


def test_bind_without_an_api_server_says_so(
    extender_factory: Callable[..., RunningExtender], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    server = extender_factory()
    the_pod = pod("p", container("main", memory=1))
    server.filter(args(the_pod, node("n0", [card(0)])))
    status, answer = server.post("bind", bind_args(the_pod, "n0"))
    assert status == 200 and "binding is not configured" in answer["Error"]
    assert len(server.ledger) == 0


@pytest.mark.parametrize(
    "body",
    [{}, {"PodName": "a"}, {"PodName": 1, "PodNamespace": "d", "PodUID": "u", "Node": "n"}, []],
)
def test_bad_binding_args_are_400(binder: RunningExtender, body: Any) -> None:
    status, answer = binder.post("bind", body)
    assert status == 400 and answer["Error"]
