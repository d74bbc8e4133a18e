"""Requests by node name (``nodeCacheCapable: true``): the extender keeps each node's
cards from its own watch of the Nodes, over real HTTP against the API-server double.

kube-scheduler then sends ``{"Pod": ..., "NodeNames": [...], "Nodes": null}`` and reads
``NodeNames`` back; the answer must be the one the same nodes get as full objects (the
older configuration, still served during a rollout), and a change to a Node's card
state reaches the answers through the watch alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit.extender import (
    CORE,
    MEMORY,
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

from gpushare.extender.podfeed import endpoint_of
from gpushare.kube import nodestate
from gpushare.kube.stdlibclient import ApiClient

__all__ = ["api", "extender_factory"]  # fixture


def names_args(the_pod: dict[str, Any], *names: str) -> dict[str, Any]:
    return {"Pod": the_pod, "Nodes": None, "NodeNames": list(names)}


def ready(server: RunningExtender) -> RunningExtender:
    eventually(lambda: get(server, "/readyz")[0] == 200)
    return server


@pytest.fixture
def cluster(
    api: KubeApiDouble, extender_factory: Callable[..., RunningExtender]
) -> tuple[KubeApiDouble, RunningExtender]:
    api.add(node("full", [card(0, used=16)]))  # 16 of 16 units used
    api.add(node("roomy", [card(0, used=4), card(1, used=0)]))
    cpu_only = node("cpu-only")
    for amounts in (cpu_only["status"]["capacity"], cpu_only["status"]["allocatable"]):
        amounts.pop(MEMORY)
        amounts.pop(CORE)
    cpu_only["metadata"]["labels"] = {"kubernetes.io/hostname": "cpu-only"}  # no daemon there
    api.add(cpu_only)
    plain = node("no-state", [card(0)])
    del plain["metadata"]["annotations"][nodestate.annotation_key("gpushare.io")]
    api.add(plain)
    server = extender_factory(api_server=api.url, token_file="", ca_file="")
    return api, ready(server)


def test_filter_by_names_keeps_the_node_whose_card_holds_the_pod_and_says_why_not(
    cluster: tuple[KubeApiDouble, RunningExtender],
) -> None:
    _api, server = cluster
    the_pod = pod("p", container("main", memory=8))
    answer = server.filter(names_args(the_pod, "full", "roomy", "cpu-only", "no-state", "gone"))
    assert answer["NodeNames"] == ["roomy"]
    assert answer["Nodes"] is None
    failed = answer["FailedNodes"]
    assert set(failed) == {"full", "cpu-only", "no-state", "gone"}
    assert "no gpushare GPUs" in failed["cpu-only"]
    assert (
        "no gpushare.io/gpu-state annotation" in failed["no-state"]
        or "annotation" in (failed["no-state"])
    )
    assert "not seen this node" in failed["gone"]


def test_names_and_full_nodes_get_the_same_answer_from_one_extender(
    cluster: tuple[KubeApiDouble, RunningExtender],
) -> None:
    api, server = cluster
    names = ["full", "roomy", "cpu-only", "no-state"]
    stored = [api.get("Node", name) for name in names]
    for memory in (1, 8, 12, 16, 17):
        the_pod = pod(f"p{memory}", container("main", memory=memory))
        by_name = server.filter(names_args(the_pod, *names))
        by_object = server.filter(args(the_pod, *stored))
        assert by_name["NodeNames"] == kept(by_object)
        assert by_name["FailedNodes"] == by_object["FailedNodes"]
        status, scores_by_name = server.post("prioritize", names_args(the_pod, *names))
        assert status == 200
        status, scores_by_object = server.post("prioritize", args(the_pod, *stored))
        assert status == 200
        assert scores_by_name == scores_by_object


def test_a_node_update_reaches_the_answers_through_the_watch(
    cluster: tuple[KubeApiDouble, RunningExtender],
) -> None:
    api, server = cluster
    the_pod = pod("big", container("main", memory=16))
    assert server.filter(names_args(the_pod, "full"))["NodeNames"] == []
    api.add(node("full", [card(0, used=0)], generation=2))  # its pods ended
    eventually(lambda: server.filter(names_args(the_pod, "full"))["NodeNames"] == ["full"])
    api.delete("Node", "full")
    answer = eventually(
        lambda: (a := server.filter(names_args(the_pod, "full")))["NodeNames"] == [] and a
    )
    assert "not seen this node" in answer["FailedNodes"]["full"]


def test_a_bind_after_a_filter_by_names_holds_room_on_the_node(
    cluster: tuple[KubeApiDouble, RunningExtender],
) -> None:
    api, server = cluster
    first = api.add(pod("first", container("main", memory=12)))
    second = api.add(pod("second", container("main", memory=12)))
    for the_pod in (first, second):
        assert server.filter(names_args(the_pod, "roomy"))["NodeNames"] == ["roomy"]
    third = pod("third", container("main", memory=5))
    assert server.filter(names_args(third, "roomy"))["NodeNames"] == ["roomy"]
    for name in ("first", "second"):
        binding = {"PodName": name, "PodNamespace": "default", "PodUID": f"uid-{name}"}
        status, answer = server.post("bind", {**binding, "Node": "roomy"})
        assert (status, answer["Error"]) == (200, "")
    # 12 + 12 of the 12 + 16 free units are held now: 4 are left on one card
    answer = server.filter(names_args(third, "roomy"))
    assert answer["NodeNames"] == []
    assert "roomy" in answer["FailedNodes"]


def test_a_bind_counts_a_node_state_the_watch_saw_after_the_filter(
    cluster: tuple[KubeApiDouble, RunningExtender],
) -> None:
    """The pod filtered before its node filled is refused at bind time. (The wait below
    goes through a filter, which also remembers the new state; the bind reads the
    node cache too, for a state that arrived with no filter in between.)"""
    api, server = cluster
    late = api.add(pod("late", container("main", memory=12)))
    assert server.filter(names_args(late, "roomy"))["NodeNames"] == ["roomy"]
    api.add(node("roomy", [card(0, used=16), card(1, used=16)], generation=5))  # filled
    eventually(
        lambda: (
            server.filter(names_args(pod("probe", container("m", memory=1)), "roomy"))["NodeNames"]
            == []
        )
    )
    binding = {"PodName": "late", "PodNamespace": "default", "PodUID": "uid-late"}
    status, answer = server.post("bind", {**binding, "Node": "roomy"})
    assert status == 200
    assert "no longer holds" in answer["Error"]
    assert not api.calls("POST", "binding")


def test_a_filter_body_never_outranks_the_node_watch(
    cluster: tuple[KubeApiDouble, RunningExtender],
) -> None:
    """Issue 41.7: one filter whose Nodes carry the next generation with every unit used
    (plausible: one publish ahead) made the node look full to every later pod, by name
    too, until its daemon published again. With its own feed the extender judges the
    nodes of a full-object request by that feed, and remembers nothing from the body."""
    api, server = cluster
    forged = node("roomy", [card(0, used=16), card(1, used=16)], generation=2)
    the_pod = pod("p", container("main", memory=8))
    assert kept(server.filter(args(the_pod, forged))) == ["roomy"]
    assert server.filter(names_args(the_pod, "roomy"))["NodeNames"] == ["roomy"]
    status, _scores = server.post("prioritize", args(the_pod, forged))
    assert status == 200
    assert server.filter(names_args(the_pod, "roomy"))["NodeNames"] == ["roomy"]
    # what the feed says still counts: the node fills, the answers follow it
    api.add(node("roomy", [card(0, used=16), card(1, used=16)], generation=3))
    eventually(lambda: server.filter(names_args(the_pod, "roomy"))["NodeNames"] == [])


def test_names_without_a_node_watch_are_refused_with_the_fix(
    extender_factory: Callable[..., RunningExtender],
) -> None:
    server = extender_factory()  # no API server: no watch
    status, answer = server.post("filter", names_args(pod("p", container("m", memory=1)), "a"))
    assert status == 400
    assert "nodeCacheCapable: false" in answer["Error"]


def test_until_the_nodes_are_listed_no_node_is_kept_and_readyz_says_so(
    api: KubeApiDouble, extender_factory: Callable[..., RunningExtender]
) -> None:
    api.add(node("roomy", [card(0)]))
    api.hold()  # the API server answers nothing yet
    try:
        server = extender_factory(api_server=api.url, token_file="", ca_file="", watch_pods=False)
        assert get(server, "/readyz")[0] == 503
        answer = server.filter(names_args(pod("p", container("m", memory=1)), "roomy"))
        assert answer["NodeNames"] == []
        assert "not read the cluster's Nodes" in answer["FailedNodes"]["roomy"]
    finally:
        api.release()
    ready(server)
    answer = server.filter(names_args(pod("p", container("m", memory=1)), "roomy"))
    assert answer["NodeNames"] == ["roomy"]


@pytest.mark.parametrize(
    "names",
    [["a", 3], "a", [""], ["x" * 254], {"a": 1}],
)
def test_bad_node_names_are_400(cluster: tuple[KubeApiDouble, RunningExtender], names: Any) -> None:
    _api, server = cluster
    body = {"Pod": pod("p", container("m", memory=1)), "NodeNames": names}
    status, answer = server.post("filter", body)
    assert status == 400
    assert "NodeNames" in answer["Error"]


BATCHES = itertools.count()
used_st = st.lists(st.integers(min_value=0, max_value=16), min_size=1, max_size=4)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(cards=st.lists(used_st, min_size=1, max_size=5), memory=st.integers(1, 17))
def test_names_answer_as_the_full_nodes_would_for_any_card_state(
    cluster: tuple[KubeApiDouble, RunningExtender], cards: list[list[int]], memory: int
) -> None:
    api, server = cluster
    batch = next(BATCHES)
    nodes = [
        node(f"h{batch}-{i}", [card(j, used=u) for j, u in enumerate(used)])
        for i, used in enumerate(cards)
    ]
    for each in nodes:
        api.add(each)
    names = [n["metadata"]["name"] for n in nodes]
    stored = [api.get("Node", name) for name in names]
    probe = pod("probe", container("m", memory=memory))
    # the watch delivers events in order: once the last node is seen, all of them are
    eventually(
        lambda: (
            "not seen"
            not in server.filter(names_args(probe, names[-1]))["FailedNodes"].get(names[-1], "")
        )
    )
    for size in (memory, 1, 16):
        the_pod = pod(f"p{size}", container("m", memory=size))
        by_name = server.filter(names_args(the_pod, *names))
        by_object = server.filter(args(the_pod, *stored))
        assert by_name["NodeNames"] == kept(by_object)
        assert by_name["FailedNodes"] == by_object["FailedNodes"]


def test_the_node_feed_reads_each_node_as_its_metadata_only(
    cluster: tuple[KubeApiDouble, RunningExtender],
) -> None:
    """A Node's status (11-32 KB at scale, rewritten by its kubelet) is never sent to the
    extender: its lists and watches ask for ``PartialObjectMetadata`` (labels and
    annotations hold all it reads), and the double answers as the real server does; a
    node whose daemon's labels are there but whose state is not is still told apart from
    a node without gpushare."""
    api, server = cluster
    reads = api.calls("GET", "/api/v1/nodes")
    assert reads, "the extender never read the nodes"
    for r in reads:
        watching = (r.query.get("watch") or [""])[0] == "1"
        asked = "PartialObjectMetadata" if watching else "PartialObjectMetadataList"
        assert r.accept.startswith(f"application/json;as={asked};g=meta.k8s.io;v=v1,"), r
    answer = server.filter(names_args(pod("p", container("main", memory=8)), "no-state"))
    assert "neither a state object nor" in answer["FailedNodes"]["no-state"]
    answer = server.filter(names_args(pod("p", container("main", memory=8)), "cpu-only"))
    assert answer["FailedNodes"]["cpu-only"] == "the node has no gpushare GPUs"


def test_the_double_answers_metadata_only_reads_as_the_real_server_does(
    api: KubeApiDouble,
) -> None:
    api.add(node("a", [card(0)]))
    client = ApiClient(endpoint_of(api.url, "", ""), metadata_only=True)
    listed = client.get("/api/v1/nodes")
    assert listed["kind"] == "PartialObjectMetadataList"
    (item,) = listed["items"]
    assert set(item) == {"kind", "apiVersion", "metadata"}
    assert item["kind"] == "PartialObjectMetadata"
    assert item["metadata"]["labels"][nodestate.label_key("gpushare.io", "count")] == "1"
    version = listed["metadata"]["resourceVersion"]
    watch = client.watch("/api/v1/nodes", {"resourceVersion": version}, 30)
    try:
        api.add(node("b", [card(0)]))
        kind, obj = next(iter(watch))
        assert (kind, obj["kind"]) == ("ADDED", "PartialObjectMetadata")
        assert obj["metadata"]["name"] == "b"
        assert "status" not in obj
    finally:
        watch.close()
