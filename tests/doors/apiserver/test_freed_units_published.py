"""Freed units reach the Node's published state promptly, and the state names the pods
its counts include.

The real daemon, the kubelet stand-in over gRPC and the API-server double over HTTP.
The periodic publish is pushed out of reach (an hour), so only a release can explain
a Node update that shows freed units.
"""

from __future__ import annotations

import math
import time

import pytest
from conftest import NODE, TESLA_P4, Node, cards, gpu_uuid
from kit.kube_double import KubeApiDouble
from kit.procs import eventually

from gpushare.gpu.gpus import Gpu
from gpushare.kube import apilink, nodestate
from gpushare.share.devices import Inventory, Resource
from gpushare.share.usage import Holder, UsageLedger


def published(api: KubeApiDouble) -> nodestate.NodeGpuState | None:
    node = api.get("Node", NODE) or {}
    text = (node.get("metadata", {}).get("annotations") or {}).get("gpushare.io/gpus")
    return nodestate.decode(text) if text else None


def pods_on(state: nodestate.NodeGpuState | None) -> dict[str, tuple[str, int, int]]:
    """pod key -> (card, memory, core) as published."""
    if state is None:
        return {}
    return {key: (card.uuid, m, c) for card in state.cards for key, m, c in card.pods or ()}


def bound_pod(api: KubeApiDouble, node: Node, name: str, requests: dict[str, int]) -> str:
    pod = node.pod(name, requests)
    pod["spec"]["nodeName"] = NODE
    pod["apiVersion"], pod["kind"] = "v1", "Pod"
    return str(api.add(pod)["metadata"]["uid"])


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """No periodic publish and no periodic read of the kubelet's records in the test."""
    monkeypatch.setattr(apilink, "RESYNC_SECONDS", 3600.0)


def start(node: Node, count: int = 2) -> None:
    node.start(cards(TESLA_P4, count), node_name=NODE, pod_resources_interval_seconds=3600)


@pytest.mark.parametrize("ending", ["deleted", "succeeded", "failed"])
def test_a_pod_that_ends_frees_its_units_on_the_node_without_waiting_for_a_refresh(
    node: Node, api: KubeApiDouble, quiet: None, ending: str
) -> None:
    start(node)
    uids = {n: bound_pod(api, node, n, {node.memory: 20, node.core: 30}) for n in ("a", "b")}
    records = {n: node.kubelet.admit(n, "main", {node.memory: 20, node.core: 30}) for n in uids}
    state = eventually(lambda: (s := published(api)) and len(pods_on(s)) == 2 and s)
    # Each pod is listed, by UID, on the card it got, with the units counted there.
    assert pods_on(state) == {uids[n]: (records[n].card(), 20, 30) for n in uids}
    assert sum(c.memory_units_used for c in state.cards) == 40
    # b ends: the kubelet forgets it, and the API server tells.
    node.kubelet.release("b")
    if ending == "deleted":
        api.delete("Pod", "b", "default")
    else:
        pod = api.get("Pod", "b", "default")
        pod["status"] = {"phase": ending.capitalize()}
        api.add(pod)
    state = eventually(lambda: (s := published(api)) and len(pods_on(s)) == 1 and s)
    assert pods_on(state) == {uids["a"]: (records["a"].card(), 20, 30)}
    assert sum(c.memory_units_used for c in state.cards) == 20
    assert sum(c.core_units_used for c in state.cards) == 30


def test_the_api_server_may_tell_before_the_kubelet_forgets(
    node: Node, api: KubeApiDouble, quiet: None
) -> None:
    """The pod is deleted from the API while the kubelet's records still show it: the
    daemon reads them again until they do not."""
    start(node, 1)
    bound_pod(api, node, "a", {node.memory: 9})
    node.kubelet.admit("a", "main", {node.memory: 9})
    eventually(lambda: len(pods_on(published(api))) == 1)
    link = node.daemon.core.api_link if node.daemon and node.daemon.core else None
    assert link is not None
    api.delete("Pod", "a", "default")
    core = node.daemon.core if node.daemon else None
    assert core is not None
    reads = core.refresher.reads
    eventually(lambda: core.refresher.reads >= reads + 2)
    node.kubelet.release("a")  # the kubelet catches up
    state = eventually(lambda: (s := published(api)) and not pods_on(s) and s)
    assert state.cards[0].memory_units_used == 0


def test_a_burst_of_endings_is_coalesced_into_few_node_writes(
    node: Node, api: KubeApiDouble, quiet: None
) -> None:
    start(node)
    names = [f"p{i}" for i in range(8)]
    for name in names:
        bound_pod(api, node, name, {node.memory: 3})
        node.kubelet.admit(name, "main", {node.memory: 3})
    eventually(lambda: len(pods_on(published(api))) == 8)
    link = node.daemon.core.api_link if node.daemon and node.daemon.core else None
    assert link is not None
    before = link.publishes
    began = time.monotonic()
    for name in names:
        node.kubelet.release(name)
        api.delete("Pod", name, "default")
    eventually(lambda: (s := published(api)) and not pods_on(s))
    spread = time.monotonic() - began
    # Eight endings, one after the other: a handful of Node updates, not one each. Writes
    # are kept MIN_PUBLISH_INTERVAL apart, so a loaded machine that spreads the endings'
    # watch events over more intervals may write once per interval, never once per ending.
    bound = max(4, 1 + math.ceil(spread / apilink.MIN_PUBLISH_INTERVAL))
    assert link.publishes - before <= min(bound, len(names) - 1), spread


def test_an_unchanged_state_is_not_written_again(
    node: Node, api: KubeApiDouble, quiet: None
) -> None:
    start(node, 1)
    eventually(lambda: published(api))
    link = node.daemon.core.api_link if node.daemon and node.daemon.core else None
    assert link is not None
    writes = link.publishes
    for _ in range(5):
        link.notify_changed()
    bound_pod(api, node, "x", {node.memory: 1})
    node.kubelet.admit("x", "main", {node.memory: 1})
    eventually(lambda: len(pods_on(published(api))) == 1)
    assert link.publishes - writes <= 2


# -- the ledger's pods are exactly what its counts include -----------------------------


def _ledger() -> tuple[UsageLedger, str]:
    gpu = Gpu(uuid=gpu_uuid(0), name="Test", memory_mib=4096, index=0, minor=0)
    return UsageLedger(Inventory([gpu], 256)), gpu_uuid(0)


def test_a_container_whose_units_are_offered_free_or_given_to_another_is_not_listed() -> None:
    usage, uuid = _ledger()
    a, b = Holder("default", "a", "main"), Holder("default", "b", "main")
    usage.replace(
        {Resource.MEMORY: {uuid: [0, 1, 2, 3]}},
        {},
        taken_at=0.0,
        held={(uuid, a): {Resource.MEMORY: {0, 1}}, (uuid, b): {Resource.MEMORY: {2, 3}}},
    )
    assert usage.counted_pods() == {uuid: {("default", "a"): (2, 0), ("default", "b"): (2, 0)}}
    usage.observe_available(Resource.MEMORY, {uuid: range(2, 16)}, [uuid])  # b's are free
    assert usage.counted_pods() == {uuid: {("default", "a"): (2, 0)}}
    usage.record_allocation(Resource.MEMORY, uuid, [1])  # one of a's goes to someone else
    assert usage.counted_pods() == {}
