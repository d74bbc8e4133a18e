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


def test_a_pod_setting_reserved_env_or_mounting_over_the_interposer_is_refused(
    cluster: Cluster,
) -> None:
    """Issue 32 item 1, envvar mode: the pod of the issue (four env lines that undid its limits)
    and a volume over the lock directory are refused by the real API server's CEL; a safe
    envFrom prefix and an emptyDir at /tmp are not."""
    pod = pod_manifest("tamper", {MEMORY: 4})
    pod["spec"]["containers"][0]["env"] = [
        {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "99999m"},
        {"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"},
        {"name": "LD_PRELOAD", "value": ""},
        {"name": "CUDA_DISABLE_CONTROL", "value": "true"},
    ]
    reply = cluster.api.create(pod, dry_run=True)
    assert reply.status_code == 403, reply.text  # reason Forbidden
    assert "gpushare-reserved-settings" in reply.json()["message"]
    assert "container(s) main set in env a variable gpushare reserves" in reply.json()["message"]
    mounted = pod_manifest("mount-lock", {MEMORY: 4})
    mounted["spec"]["volumes"] = [{"name": "v", "emptyDir": {}}]
    mounted["spec"]["containers"][0]["volumeMounts"] = [{"name": "v", "mountPath": "/tmp/vgpulock"}]
    reply = cluster.api.create(mounted, dry_run=True)
    assert reply.status_code == 403, reply.text  # reason Forbidden
    assert "mount a volume at or below a path gpushare uses" in reply.json()["message"]
    fine = pod_manifest("fine", {MEMORY: 4})
    fine["spec"]["volumes"] = [{"name": "v", "emptyDir": {}}]
    fine["spec"]["containers"][0]["volumeMounts"] = [{"name": "v", "mountPath": "/tmp"}]
    fine["spec"]["containers"][0]["envFrom"] = [{"prefix": "APP_", "configMapRef": {"name": "c"}}]
    reply = cluster.api.create(fine, dry_run=True)
    assert reply.status_code == 201, reply.text
