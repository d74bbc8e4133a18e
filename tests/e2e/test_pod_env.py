"""A pod's own spec cannot change the limits its container gets (issue 32 item 1), judged on what
the runtime FINALLY applies: the CRI fake merges the kubelet's env (the later duplicate wins) and
applies the CDI devices the kubelet names as the CDI library does (its edits replace the env and
mounts the pod set), then runs their createRuntime hooks (e2e/cmd/crifake).

Before the fix a real kubelet admitted the issue's pod (4 memory units, and in its spec
``CUDA_DEVICE_MEMORY_LIMIT_0=99999m``, ``CUDA_DEVICE_SM_LIMIT=100``, ``LD_PRELOAD=""``,
``CUDA_DISABLE_CONTROL=true``) and its container ran with the tenant's values.

* The policy (on by default) refuses the pod at the API server under every device-list strategy
  (``test_policies.py`` for envvar, here for ``cdi-cri``: a CDI spec replaces only the names it
  sets, HAMi-core reads more), and with the policy's binding removed the daemon refuses it at
  Allocate: the pod fails admission, nothing is created.
* CDI mode (a cluster of its own, ``--device-list-strategy cdi-cri``, the chart's policies for
  that strategy): every grant's env rides on a CDI spec of the daemon's own, whole cards and MIG
  devices too. With the policy's binding removed, a pod asking one whole card (or one MIG device)
  whose spec sets ``NVIDIA_VISIBLE_DEVICES=all`` runs with ``void`` in its final env and the
  grant's spec applied (on main the answer's ``void`` came first and the tenant's ``all`` won).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
import yaml
from e2e_nodes import CARD_4GIB, cards, gpu_uuid
from kube_cluster import (
    MEMORY,
    REPO,
    WHOLE,
    Cluster,
    NodeSpec,
    pod_manifest,
    running_cluster,
    wait_for,
)
from test_whole_and_mig import MIG_1G, MIG_CARD, mig_uuid

ISSUE_ENV = [
    {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "99999m"},
    {"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"},
    {"name": "LD_PRELOAD", "value": ""},
    {"name": "CUDA_DISABLE_CONTROL", "value": "true"},
]
CORE = MEMORY.replace("vcuda-memory", "vcuda-core")
POLICY = "admissionregistration.k8s.io/v1"
#: What would widen a whole card's or MIG device's container to every card of the node (the
#: NVIDIA runtime reads the variable).
WIDEN_ENV = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]


def _tenant(name: str) -> dict[str, Any]:
    pod = pod_manifest(name, {MEMORY: 4, CORE: 30})
    pod["spec"]["containers"][0]["env"] = ISSUE_ENV
    return pod


@contextlib.contextmanager
def policy_off(cluster: Cluster) -> Iterator[None]:
    """The binding of ``gpushare-reserved-settings`` removed (a cluster without the policy),
    put back afterwards."""
    binding = f"/apis/{POLICY}/validatingadmissionpolicybindings/gpushare-reserved-settings"
    saved = cluster.api.get(binding)
    saved["metadata"] = {
        "name": saved["metadata"]["name"],
        "labels": saved["metadata"].get("labels", {}),
    }
    assert cluster.api.delete(binding).status_code == 200
    try:
        wait_for(
            "the policy out of force",
            lambda: cluster.api.create(_tenant("probe"), dry_run=True).status_code == 201,
            60,
            step=0.5,
        )
        yield
    finally:
        cluster.api.apply_all(
            [saved | {"apiVersion": POLICY, "kind": "ValidatingAdmissionPolicyBinding"}]
        )
        cluster.wait_policies_in_force()


def _refused_at_allocate(cluster: Cluster, name: str) -> None:
    """The issue's pod, the policy off: the daemon refuses its Allocate, nothing is created."""
    cluster.create_pod(_tenant(name))
    try:
        pod = cluster.wait_pod("default", name, "Failed")
        message = (pod.get("status") or {}).get("message", "")
        assert "sets CUDA_DEVICE_MEMORY_LIMIT_0" in message, pod.get("status")
        assert name not in {r["pod"] for n in cluster.nodes.values() for r in n.records()}
    finally:
        cluster.delete_pod("default", name)


def test_envvar_the_daemon_refuses_the_pod_where_the_policy_is_off(cluster: Cluster) -> None:
    with policy_off(cluster):
        _refused_at_allocate(cluster, "tamper-envvar")


def _chart_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    kinds = {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    with helm_python.Chart.load(REPO / "charts" / "gpushare") as chart:
        rendered = chart.render(values, name="gpushare", namespace="kube-system", is_install=True)
    return [
        o
        for path, text in rendered.items()
        if path.endswith(".yaml")
        for o in yaml.safe_load_all(text)
        if o and o["kind"] in kinds
    ]


@pytest.fixture(scope="module")
def cdi_cluster() -> Iterator[Cluster]:
    logs = REPO / "e2e" / "logs" / "cdi-cluster"
    with running_cluster([], logs=logs, install=False) as c:
        c.api.apply_all(_chart_objects({"config": {"deviceListStrategy": "cdi-cri"}}))
        c.wait_policies_in_force()
        gpus = [*cards(7, CARD_4GIB, 2), MIG_CARD]
        cdi = c.dir / "node-1" / "cdi"
        cdi.mkdir(parents=True)
        # the cards' and MIG devices' own CDI names, as nvidia-ctk or the GPU Operator would
        # write them (nvidia-ctk's own edits set NVIDIA_VISIBLE_DEVICES=void)
        names = [g["uuid"] for g in gpus[:2]] + [i["uuid"] for i in MIG_CARD["instances"]]
        (cdi / "nvidia.com-gpu.json").write_text(
            json.dumps(
                {
                    "cdiVersion": "0.5.0",
                    "kind": "nvidia.com/gpu",
                    "devices": [
                        {"name": n, "containerEdits": {"env": ["NVIDIA_SIM_CARD=1"]}}
                        for n in names
                    ],
                }
            )
        )
        args = [
            "--device-list-strategy=cdi-cri",
            f"--dra-cdi-dir={cdi}",
            f"--cdi-spec-dirs={cdi}",
            "--whole-cards",
            "--mig-strategy=mixed",
        ]
        c.add_node(NodeSpec("node-1", gpus, daemon_args=args))
        yield c


def test_cdi_the_policy_refuses_the_issue_pod_too(cdi_cluster: Cluster) -> None:
    """The chart under ``cdi-cri`` keeps the env rules (on main it dropped them)."""
    reply = cdi_cluster.api.create(_tenant("tamper-cdi"), dry_run=True)
    assert reply.status_code == 403, reply.text
    assert "set in env a variable gpushare reserves" in reply.json()["message"]
    whole = pod_manifest("widen", {WHOLE: 1})
    whole["spec"]["containers"][0]["env"] = WIDEN_ENV
    reply = cdi_cluster.api.create(whole, dry_run=True)
    assert reply.status_code == 403, reply.text


def test_cdi_the_daemon_refuses_the_issue_pod_where_the_policy_is_off(
    cdi_cluster: Cluster,
) -> None:
    with policy_off(cdi_cluster):
        _refused_at_allocate(cdi_cluster, "tamper-cdi")


@pytest.mark.parametrize(
    ("resource", "devices"),
    [(WHOLE, {gpu_uuid(7, 0), gpu_uuid(7, 1)}), (MIG_1G, {mig_uuid(2), mig_uuid(3)})],
)
def test_cdi_a_whole_card_or_mig_device_keeps_its_devices_in_the_final_env(
    cdi_cluster: Cluster, resource: str, devices: set[str]
) -> None:
    """The policy off (the daemon's whole-card and MIG doors read no pod spec): the seal is
    what holds. Before the fix the answer's ``void`` came first and the tenant's ``all`` won."""
    name = "widen-" + resource.rsplit("/", 1)[1].replace(".", "-")
    pod = pod_manifest(name, {resource: 1})
    pod["spec"]["containers"][0]["env"] = WIDEN_ENV
    with policy_off(cdi_cluster):
        cdi_cluster.create_pod(pod)
        try:
            cdi_cluster.wait_pod("default", name, "Running")
            record = cdi_cluster.wait_record("node-1", "default", name, "main")
            assert record.get("error") is None, record
            assert record["env"]["NVIDIA_VISIBLE_DEVICES"] == "void", record["env"]
            sent = [e["value"] for e in record["cri_env"] if e["name"] == "NVIDIA_VISIBLE_DEVICES"]
            assert sent == ["all"], record["cri_env"]  # the kubelet sent only the tenant's
            applied = record["cdi_applied"]
            (card,) = [n for n in applied if n.startswith("nvidia.com/gpu=")]
            (grant,) = [n for n in applied if n.startswith("gpushare.io/grant=")]
            assert card.split("=")[1] in devices, applied
            assert grant.startswith("gpushare.io/grant=whole-")
            assert applied.index(card) < applied.index(grant)  # ours last
        finally:
            cdi_cluster.delete_pod("default", name)
