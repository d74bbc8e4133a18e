"""Scenario 6: a node with whole cards (``--whole-cards``) and a MIG card (``--mig-strategy
mixed``), added to the running cluster: the real kubelet serves all the resources, a card held
whole offers no shared units (and a card with shared units is not offered whole), MIG pods get
their instance; ``kubectl gpushare inspect`` reads the node from the real API server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_nodes import TESLA_P4, cards
from kube_cluster import CORE, MEMORY, PREFIX, WHOLE, Cluster, NodeSpec, pod_manifest, wait_for

NODE = "node-3"
A100 = "GPU-7780f282-99a1-7024-f7a4-65a55230ed76"
MIG_3G, MIG_2G, MIG_1G = (f"{PREFIX}/mig-{p}" for p in ("3g.20gb", "2g.10gb", "1g.5gb"))


def mig_uuid(n: int) -> str:
    return f"MIG-{n:08x}-7780-5000-8000-65a55230ed76"


#: An A100-SXM4-40GB cut as ``nvidia-smi mig -cgi 9,14,19,19``: 3g.20gb, 2g.10gb, 2 x 1g.5gb.
MIG_CARD = {
    "uuid": A100,
    "name": "A100-SXM4-40GB",
    "memory_mib": 40536,
    "index": 2,
    "numa_node": 0,
    "mig": True,
    "instances": [
        {
            "uuid": mig_uuid(0),
            "profile": "3g.20gb",
            "memory_mib": 20096,
            "gi": 2,
            "ci": 0,
            "sm": 42,
        },
        {"uuid": mig_uuid(1), "profile": "2g.10gb", "memory_mib": 9984, "gi": 3, "ci": 0, "sm": 28},
        {"uuid": mig_uuid(2), "profile": "1g.5gb", "memory_mib": 4864, "gi": 9, "ci": 0, "sm": 14},
        {"uuid": mig_uuid(3), "profile": "1g.5gb", "memory_mib": 4864, "gi": 10, "ci": 0, "sm": 14},
    ],
}
P4S = cards(3, TESLA_P4, 2)
FULL = {WHOLE: 2, MEMORY: 58, CORE: 200, MIG_3G: 1, MIG_2G: 1, MIG_1G: 2}


@pytest.fixture(scope="module")
def node3(cluster: Cluster) -> Iterator[str]:
    spec = NodeSpec(
        NODE, [*P4S, MIG_CARD], daemon_args=["--whole-cards", "--mig-strategy", "mixed"]
    )
    cluster.add_node(spec)
    yield NODE
    cluster.remove_node(NODE)


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        cluster.delete_pod("default", name)


def counts(alloc: dict[str, str]) -> dict[str, int]:
    return {r: int(alloc.get(r, "0")) for r in FULL}


def start(cluster: Cluster, pods: list[str], name: str, limits: dict[str, int]) -> dict[str, Any]:
    pods.append(name)
    cluster.create_pod(pod_manifest(name, limits, node=NODE))
    cluster.wait_pod("default", name, "Running")
    return cluster.wait_record(NODE, "default", name, "main")["env"]


def test_the_node_offers_whole_cards_shared_units_and_mig(cluster: Cluster, node3: str) -> None:
    alloc = cluster.wait_allocatable(NODE, lambda a: counts(a) == FULL)
    assert counts(alloc) == FULL


def test_whole_and_shared_exclude_each_other_on_a_card(
    cluster: Cluster, node3: str, pods: list[str]
) -> None:
    whole = start(cluster, pods, "whole-one", {WHOLE: 1})
    held = whole["NVIDIA_VISIBLE_DEVICES"]
    assert held in {g["uuid"] for g in P4S}
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in whole
    # The held card's 29 units leave the node's allocatable.
    cluster.wait_allocatable(NODE, lambda a: counts(a)[MEMORY] == 29)
    shared = start(cluster, pods, "shared-one", {MEMORY: 4, CORE: 10})
    other = shared["NVIDIA_VISIBLE_DEVICES"]
    assert other in {g["uuid"] for g in P4S} and other != held
    # ... and the card with shared units in use is no longer offered whole (the card held
    # whole stays listed: the kubelet's allocatable counts allocated devices too).
    cluster.wait_allocatable(NODE, lambda a: counts(a)[WHOLE] == 1)


def test_a_mig_pod_gets_its_instance(cluster: Cluster, node3: str, pods: list[str]) -> None:
    env = start(cluster, pods, "mig-small", {MIG_1G: 1})
    assert env["NVIDIA_VISIBLE_DEVICES"] in {mig_uuid(2), mig_uuid(3)}
    env = start(cluster, pods, "mig-big", {MIG_3G: 1})
    assert env["NVIDIA_VISIBLE_DEVICES"] == mig_uuid(0)


def test_everything_is_offered_again_once_released(cluster: Cluster, node3: str) -> None:
    alloc = cluster.wait_allocatable(NODE, lambda a: counts(a) == FULL)
    assert counts(alloc) == FULL


def test_kubectl_gpushare_inspect_reads_the_real_server(
    cluster: Cluster, node3: str, pods: list[str]
) -> None:
    start(cluster, pods, "inspect-me", {MEMORY: 8, CORE: 20})

    # node-3's state is written by its daemon's API link on a thread of its own (with this
    # test run alone, just after the node was added): wait until the report shows it
    def report() -> str | None:
        reply = cluster.kubectl_gpushare("inspect", "-o", "json")
        assert reply.returncode == 0, reply.stderr
        text = json.dumps(json.loads(reply.stdout))
        return text if all(n in text for n in ("node-1", "node-2", NODE)) else None

    text = wait_for("inspect to report the three nodes", report, 60, step=0.5)
    for node in ("node-1", "node-2", NODE):
        assert node in text

    # inspect reads the Node annotation, which the daemon rewrites shortly after admitting.
    def details() -> str | None:
        out = cluster.kubectl_gpushare("inspect", "-d", NODE).stdout
        return out if "inspect-me" in out else None

    assert "inspect-me" in wait_for("inspect -d to list the pod", details, 60, step=0.5)
