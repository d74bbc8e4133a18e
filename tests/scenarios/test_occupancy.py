"""What occupies a card, end to end: the real daemon publishing over HTTP to the
API-server double, the kubelet stand-in admitting over gRPC, the real extender over
HTTP binding through the double and watching its pods.

A hold on a bound pod ends when the published state lists that pod,
not at the daemon's next publish. A pod that ends frees its room in the
extender at once, before the daemon publishes; a restarted extender starts from the
published state and the API server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from conftest import CARD_4GIB, NODE, TESLA_P4, Node, cards
from kit.extender import RunningExtender, args, container, extender_factory, get, kept, pod
from kit.kube_double import KubeApiDouble
from kit.procs import eventually

from gpushare.kube import apilink, nodestate
from gpushare.sim.kubeletdouble import AdmissionError

__all__ = ["extender_factory"]  # fixture


class Cluster:
    """One node (one Tesla P4: 29 units), its daemon, the extender, the API double."""

    def __init__(self, node: Node, api: KubeApiDouble, make: Callable[..., RunningExtender]):
        self.node, self.api, self.make = node, api, make
        self.extender = self.new_extender()

    def new_extender(self) -> RunningExtender:
        """A started extender once it is ready (its pods and Nodes read: /readyz 200), as
        the Service in front of it routes kube-scheduler to it only then; a filter before
        that keeps no node (test_a_restarted_extender_keeps_no_node_until_it_has_read_the_pods)."""
        server = self.make(api_server=self.api.url, token_file="", ca_file="")
        eventually(lambda: get(server, "/readyz")[0] == 200)
        return server

    def node_object(self) -> dict[str, Any]:
        the_node = self.api.get("Node", NODE)
        assert the_node is not None
        return the_node

    def listed(self) -> set[str]:
        annotations = self.node_object()["metadata"].get("annotations") or {}
        text = annotations.get("gpushare.io/gpus")
        if not text:
            return set()
        state = nodestate.decode(text)
        return {key for card in state.cards for key, _m, _c in card.pods or ()}

    def create(self, name: str, memory: int) -> dict[str, Any]:
        the_pod = pod(name, container("main", memory=memory))
        del the_pod["metadata"]["uid"]  # the double gives one
        return self.api.add(the_pod)

    def uid(self, name: str) -> str:
        the_pod = self.api.get("Pod", name, "default")
        assert the_pod is not None
        return str(the_pod["metadata"]["uid"])

    def schedule(self, name: str, node_object: dict[str, Any] | None = None) -> str:
        """Filter and bind as kube-scheduler does; "" if bound, else why not."""
        the_pod = self.api.get("Pod", name, "default")
        assert the_pod is not None
        answer = self.extender.filter(args(the_pod, node_object or self.node_object()))
        if not kept(answer):
            return str(answer["FailedNodes"][NODE])
        meta = the_pod["metadata"]
        body = {"PodName": name, "PodNamespace": "default", "PodUID": meta["uid"], "Node": NODE}
        status, bound = self.extender.post("bind", body)
        assert status == 200
        return str(bound["Error"])

    def admit(self, name: str, memory: int) -> None:
        self.node.kubelet.admit(name, "main", {self.node.memory: memory})

    def delete(self, name: str) -> None:
        self.node.kubelet.release(name)
        self.api.delete("Pod", name, "default")


@pytest.fixture
def cluster(
    node: Node,
    api: KubeApiDouble,
    extender_factory: Callable[..., RunningExtender],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> Cluster:
    monkeypatch.setattr(apilink, "RESYNC_SECONDS", 3600.0)  # publishes come from changes
    gpus = getattr(request, "param", cards(TESLA_P4, 1))
    node.start(gpus, node_name=NODE, pod_resources_interval_seconds=3600)
    eventually(
        lambda: "gpushare.io/gpus" in (api.get("Node", NODE)["metadata"].get("annotations") or {})
    )
    return Cluster(node, api, extender_factory)


def test_a_hold_lasts_until_the_published_state_counts_the_pod(cluster: Cluster) -> None:
    """Three 12-unit pods and one 1-unit pod for one 29-unit card: the third 12 must
    wait, although the daemon publishes (for the small pod) before the second 12 is
    admitted."""
    for name, memory in (("small", 1), ("p1", 12), ("p2", 12), ("p3", 12)):
        cluster.create(name, memory)
    assert cluster.schedule("small") == ""
    assert cluster.schedule("p1") == ""
    cluster.admit("p1", 12)
    eventually(lambda: cluster.uid("p1") in cluster.listed())
    assert cluster.schedule("p2") == ""  # bound; the kubelet has not admitted it yet
    cluster.admit("small", 1)  # the daemon publishes a new generation without p2
    eventually(lambda: cluster.uid("small") in cluster.listed())
    assert cluster.uid("p2") not in cluster.listed()
    reason = cluster.schedule("p3")
    assert reason.startswith("no single card has 12 free units: GPU0 4 (counting 1 pod(s)")
    cluster.admit("p2", 12)  # the card holds everything the extender bound
    eventually(lambda: cluster.uid("p2") in cluster.listed())
    assert cluster.schedule("p3").startswith("no single card has 12 free units: GPU0 4")
    assert len(cluster.extender.ledger) == 0  # every hold confirmed by the state, none timed out
    with pytest.raises(AdmissionError):
        cluster.admit("p3", 12)  # what binding p3 would have led to


def test_room_freed_by_a_deleted_pod_is_seen_before_the_daemon_publishes(
    cluster: Cluster,
) -> None:
    for name in ("p1", "p2", "p3"):
        cluster.create(name, 12)
    for name in ("p1", "p2"):
        assert cluster.schedule(name) == ""
        cluster.admit(name, 12)
    eventually(lambda: {cluster.uid("p1"), cluster.uid("p2")} <= cluster.listed())
    before = cluster.node_object()  # the scheduler's copy, from before the deletion
    assert cluster.schedule("p3", before).startswith("no single card has 12 free units")
    cluster.delete("p1")
    # The extender hears of the deletion through its watch: the old Node object fits.
    eventually(
        lambda: kept(cluster.extender.filter(args(cluster.api.get("Pod", "p3", "default"), before)))
    )
    assert cluster.schedule("p3", before) == ""
    cluster.admit("p3", 12)  # the room was really there


def test_a_finished_pod_frees_its_room_and_a_running_one_does_not(cluster: Cluster) -> None:
    for name in ("job", "svc", "next"):
        cluster.create(name, 14)
    for name in ("job", "svc"):
        assert cluster.schedule(name) == ""
        cluster.admit(name, 14)
    eventually(lambda: {cluster.uid("job"), cluster.uid("svc")} <= cluster.listed())
    before = cluster.node_object()
    running = cluster.api.get("Pod", "svc", "default")
    running["status"] = {"phase": "Running"}
    cluster.api.add(running)
    finished = cluster.api.get("Pod", "job", "default")
    finished["status"] = {"phase": "Succeeded"}
    cluster.api.add(finished)
    cluster.node.kubelet.release("job")
    eventually(
        lambda: kept(
            cluster.extender.filter(args(cluster.api.get("Pod", "next", "default"), before))
        )
    )
    assert cluster.schedule("next", before) == ""
    cluster.admit("next", 14)


def test_a_restarted_extender_counts_pods_bound_before_it_started(cluster: Cluster) -> None:
    for name in ("p1", "p2"):
        cluster.create(name, 20)
    assert cluster.schedule("p1") == ""  # bound; neither admitted nor published
    cluster.extender.__exit__()
    cluster.extender = cluster.new_extender()  # an empty ledger, a fresh list of pods
    reason = cluster.schedule("p2")
    assert reason.startswith("no single card has 20 free units: GPU0 9 (counting 1 pod(s)")
    cluster.admit("p1", 20)
    eventually(lambda: cluster.uid("p1") in cluster.listed())
    assert cluster.schedule("p2").startswith("no single card has 20 free units: GPU0 9")


@pytest.mark.parametrize("cluster", [cards(CARD_4GIB, 2)], indirect=True)
def test_pods_admitted_in_another_order_than_bound_land_where_the_extender_counted(
    cluster: Cluster,
) -> None:
    """A rare refusal once seen: ``a container must stay on one GPU`` for a pod the
    extender had placed. Two 16-unit cards; the extender binds 10, 10, 6, 6 (one 10 and
    one 6 per card). A kubelet that admits them in another order (after a restart it
    admits by creation time; bindings posted together land in any order) used to put
    both 6s on one card, where the daemon's binpack sends the first two: the last 10
    then found no single card. The daemon now follows the plan the extender wrote with
    each Binding."""
    sizes = {"p1": 10, "p2": 10, "p3": 6, "p4": 6}
    for name, memory in sizes.items():
        cluster.create(name, memory)
    for name in sizes:
        assert cluster.schedule(name) == ""
    plans = {
        name: cluster.api.get("Pod", name, "default")["metadata"]["annotations"]["gpushare.io/plan"]
        for name in sizes
    }
    core = cluster.node.daemon.core if cluster.node.daemon else None
    book = core.specs if core else None
    assert book is not None
    eventually(lambda: all(len(book.named("default", name)) == 1 for name in sizes))
    placed = {}
    for name in ("p3", "p4", "p1", "p2"):  # not the order they were bound in
        cluster.admit(name, sizes[name])
        placed[name] = cluster.node.kubelet.admitted[("default", name, "main")].card()
    assert {name: json.loads(plans[name])["main"] for name in sizes} == placed


def test_a_restarted_extender_keeps_no_node_until_it_has_read_the_pods(
    api: KubeApiDouble, extender_factory: Callable[..., RunningExtender]
) -> None:
    """Never from an empty ledger: while the pod list cannot be read, the filter keeps
    no node and /readyz says so; once it is read, the node is kept."""
    from kit.extender import card, node

    api.add(node("n0", [card(0)]))
    api.fail_next(1000, status=503)
    server = extender_factory(api_server=api.url, token_file="", ca_file="")
    the_pod = pod("p", container("main", memory=1))
    answer = server.filter(args(the_pod, node("n0", [card(0)])))
    # neither the pods nor the Nodes (the extender's own feed, which it judges the
    # request's Nodes by) are read yet
    assert answer["FailedNodes"]["n0"].startswith("the extender has not read the cluster's")
    assert get(server, "/readyz")[0] == 503
    with api._lock:
        api._failures.clear()  # the API server answers again
    eventually(lambda: kept(server.filter(args(the_pod, node("n0", [card(0)])))) == ["n0"])
    # ready once the node watch's own retry has listed the Nodes too
    eventually(lambda: get(server, "/readyz")[0] == 200)
