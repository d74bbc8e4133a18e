"""Time-sliced replicas on the real kubelet and scheduler: a node with one card in card mode
``timeslice`` (3 replicas of ``<prefix>/gpu.shared``) and one shared card, added to the
running cluster. Three pods asking one replica each run on the sliced card, with no limits;
a fourth is refused by the scheduler (the kubelet's count) and runs, on the same card, once
one of the three is deleted (the replica is handed back); the shared card keeps its units."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_nodes import TESLA_P4, cards
from kube_cluster import CORE, MEMORY, PREFIX, Cluster, NodeSpec, pod_manifest

NODE = "node-8"
SHARED_GPU = f"{PREFIX}/gpu.shared"
P4S = cards(8, TESLA_P4, 2)


@pytest.fixture(scope="module")
def sliced_node(cluster: Cluster) -> Iterator[str]:
    spec = NodeSpec(
        NODE, P4S, daemon_args=["--card-modes", "0=timeslice", "--time-slice-replicas", "3"]
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


def test_a_time_sliced_card_hands_out_n(
    cluster: Cluster, sliced_node: str, pods: list[str]
) -> None:
    alloc = cluster.wait_allocatable(
        NODE, lambda a: a.get(SHARED_GPU) == "3" and a.get(MEMORY) == "29"
    )
    assert alloc.get(CORE) == "100"  # only the shared card offers units
    for i in range(3):
        name = f"sliced-{i}"
        pods.append(name)
        cluster.create_pod(pod_manifest(name, {SHARED_GPU: 1}, node=NODE))
    for name in pods:
        cluster.wait_pod("default", name, "Running")
        env = cluster.wait_record(NODE, "default", name, "main")["env"]
        assert env["NVIDIA_VISIBLE_DEVICES"] == P4S[0]["uuid"]
        assert not any(k.startswith(("CUDA_DEVICE_", "LD_PRELOAD")) for k in env)
    pods.append("sliced-3")
    cluster.create_pod(pod_manifest("sliced-3", {SHARED_GPU: 1}, node=None))
    cluster.wait_scheduling_refused("default", "sliced-3")
    cluster.delete_pod("default", "sliced-0")
    pods.remove("sliced-0")
    cluster.wait_pod("default", "sliced-3", "Running")
    env = cluster.wait_record(NODE, "default", "sliced-3", "main")["env"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == P4S[0]["uuid"]
