"""Scenario 3: the project's ValidatingAdmissionPolicies (daemonset/policies/), evaluated by the
real API server's CEL on real pod creations."""

from __future__ import annotations

import pytest
from kube_cluster import CORE, MEMORY, WHOLE, Cluster, pod_manifest


def create(cluster: Cluster, name: str, containers: dict[str, dict[str, int]]) -> tuple[int, str]:
    reply = cluster.api.create(pod_manifest(name, containers=containers), dry_run=True)
    return reply.status_code, reply.json().get("message", "")


def test_core_without_memory_is_refused(cluster: Cluster) -> None:
    code, message = create(cluster, "core-only", {"main": {CORE: 20}})
    assert code == 422, message
    assert "gpushare-core-needs-memory" in message
    assert "container(s) main ask for gpushare.io/vcuda-core without" in message


def test_core_without_memory_in_an_init_container_is_refused(cluster: Cluster) -> None:
    pod = pod_manifest("init-core-only", {MEMORY: 4, CORE: 10})
    pod["spec"]["initContainers"] = [
        {
            "name": "init",
            "image": "registry.k8s.io/pause:3.10",
            "resources": {"limits": {CORE: "5"}},
        }
    ]
    reply = cluster.api.create(pod, dry_run=True)
    assert reply.status_code == 422, reply.text
    assert "container(s) init ask" in reply.json()["message"]


@pytest.mark.parametrize("whole", [WHOLE, "gpushare.io/mig-1g.5gb"])
def test_shared_units_with_whole_cards_or_mig_are_refused(cluster: Cluster, whole: str) -> None:
    code, message = create(cluster, "mixed", {"main": {MEMORY: 4, whole: 1}})
    assert code == 422, message
    assert "together with whole cards or MIG" in message


def test_pods_the_policies_allow(cluster: Cluster) -> None:
    for name, containers in {
        "memory-only": {"main": {MEMORY: 4}},
        "memory-and-core": {"main": {MEMORY: 4, CORE: 10}},
        "whole-only": {"main": {WHOLE: 1}},
        "split-kinds": {"shared": {MEMORY: 4, CORE: 10}, "whole": {WHOLE: 1}},
        "no-gpu": {"main": {}},
    }.items():
        code, message = create(cluster, name, containers)
        assert code == 201, (name, message)


def test_zero_memory_with_cores_is_refused(cluster: Cluster) -> None:
    """``vcuda-memory: "0"`` once passed the key check (the key is there), and the real
    kubelet then ran the container on a card with a core limit and no memory limit at all:
    the policy compares quantities now, with the API server's own ``quantity()``."""
    code, message = create(cluster, "zero-memory", {"main": {MEMORY: 0, CORE: 10}})
    assert code == 422, message


@pytest.mark.parametrize(
    ("limits", "said"),
    [
        ({MEMORY: 4, CORE: 150}, "more than 100 gpushare.io/vcuda-core (main asks 150)"),
        ({MEMORY: "4Gi"}, "main: 4Gi is 4294967296 units of 256 MiB; did you mean 16?"),
        # the API server stores 3000 in canonical form, 3k, before admission sees it
        ({MEMORY: 3000}, "main: 3k is 3000 units of 256 MiB; did you mean 12?"),
    ],
)
def test_a_quantity_no_container_can_mean_is_refused_with_the_unit(
    cluster: Cluster, limits: dict[str, int | str], said: str
) -> None:
    """Issue 33.4, with the API server's own quantity library (asInteger, isInteger)."""
    code, message = create(cluster, "nonsense", {"main": limits})  # type: ignore[dict-item]
    assert code == 422, message
    assert said in message, message
    code, message = create(cluster, "largest", {"main": {MEMORY: 2048, CORE: 100}})
    assert code == 201, message
