"""Scenario 2: pods asking shared units, placed by the real scheduler and admitted by the real
kubelet: every container's units on one card, the same card in the env the runtime got and in
the kubelet's PodResources records; a pod no card can hold is refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from e2e_nodes import NODES
from kube_cluster import CORE, MEMORY, Cluster, pod_manifest


def uuids(node: str) -> set[str]:
    return {g["uuid"] for g in next(n for n in NODES if n.name == node).gpus}


def podresources_cards(cluster: Cluster, node: str, pod: str) -> dict[str, dict[str, set[str]]]:
    """container -> resource -> the cards (UUIDs) of the device IDs the kubelet recorded."""
    out: dict[str, dict[str, set[str]]] = {}
    for entry in cluster.nodes[node].pod_resources():
        if entry.get("name") != pod or entry.get("namespace") != "default":
            continue
        for c in entry.get("containers", []):
            per = out.setdefault(c["name"], {})
            for dev in c.get("devices", []):
                # gpushare's device IDs are <card UUID>::<unit number>
                per.setdefault(dev["resource_name"], set()).update(
                    i.rpartition("::")[0] for i in dev.get("device_ids", [])
                )
    return out


def count_ids(cluster: Cluster, node: str, pod: str, container: str, resource: str) -> int:
    """How many device IDs of ``resource`` PodResources lists for the container (the 1.36
    kubelet lists one ContainerDevices entry per device, each with its NUMA node)."""
    total = 0
    for entry in cluster.nodes[node].pod_resources():
        if entry.get("name") == pod and entry.get("namespace") == "default":
            for c in entry.get("containers", []):
                if c["name"] == container:
                    for dev in c.get("devices", []):
                        if dev["resource_name"] == resource:
                            total += len(dev.get("device_ids", []))
    return total


def check_one_card(
    cluster: Cluster,
    node: str,
    pod: str,
    limits: dict[str, dict[str, int]],
) -> dict[str, str]:
    """Each container's env names one card of the node with its memory limit, and PodResources
    puts all its units on that same card. Returns container -> card."""
    records = cluster.records(node, "default", pod)
    recorded = podresources_cards(cluster, node, pod)
    chosen = {}
    for container, lim in limits.items():
        env = records[container]["env"]
        card = env["NVIDIA_VISIBLE_DEVICES"]
        assert "," not in card and card in uuids(node), env
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{lim[MEMORY] * 256}m", env
        assert recorded[container][MEMORY] == {card}, (container, recorded)
        assert count_ids(cluster, node, pod, container, MEMORY) == lim[MEMORY]
        if CORE in lim:
            assert recorded[container][CORE] == {card}, (container, recorded)
            assert count_ids(cluster, node, pod, container, CORE) == lim[CORE]
        chosen[container] = card
    return chosen


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[list[str]]:
    """Names of the pods a test created, deleted afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        cluster.delete_pod("default", name)


def run(cluster: Cluster, pods: list[str], name: str, **kwargs: Any) -> dict[str, Any]:
    pods.append(name)
    cluster.create_pod(pod_manifest(name, **kwargs))
    return cluster.wait_pod("default", name, "Running")


def test_each_pod_gets_its_units_on_one_card(cluster: Cluster, pods: list[str]) -> None:
    limits = {MEMORY: 8, CORE: 30}
    for i in range(4):
        pod = run(cluster, pods, f"shared-{i}", limits=limits, node="node-1")
        assert pod["spec"]["nodeName"] == "node-1"
    for i in range(4):
        check_one_card(cluster, "node-1", f"shared-{i}", {"main": limits})


def test_two_containers_each_on_one_card(cluster: Cluster, pods: list[str]) -> None:
    # 20 + 20 units: more than one P4 holds (29), so the containers get two cards.
    limits = {"a": {MEMORY: 20, CORE: 40}, "b": {MEMORY: 20, CORE: 40}}
    run(cluster, pods, "shared-two", containers=limits, node="node-1")
    chosen = check_one_card(cluster, "node-1", "shared-two", limits)
    assert chosen["a"] != chosen["b"]


def test_the_default_scheduler_places_by_totals(cluster: Cluster, pods: list[str]) -> None:
    """The stock scheduler counts node totals only: 20 units fit node-2's 32 but neither of its
    16-unit cards, and the kubelet's admission (the daemon's answer) refuses the pod."""
    name = "shared-too-big"
    pods.append(name)
    cluster.create_pod(pod_manifest(name, {MEMORY: 20}, node="node-2"))

    def failed() -> dict[str, Any] | None:
        pod = cluster.pod("default", name)
        return pod if pod and pod["status"].get("phase") == "Failed" else None

    from kube_cluster import wait_for

    pod = wait_for(f"{name} to fail admission", failed, 90)
    assert pod["spec"]["nodeName"] == "node-2"
    assert pod["status"].get("reason") == "UnexpectedAdmissionError", pod["status"]
