"""A pod's own spec cannot change the limits its container gets (issue 32 item 1), judged on what
the runtime FINALLY applies: the CRI fake merges the kubelet's env (the later duplicate wins) and
applies the CDI devices the kubelet names as the CDI library does (its edits replace the env and
mounts the pod set), then runs their createRuntime hooks (e2e/cmd/crifake).

Before the fix a real kubelet admitted the issue's pod (4 memory units, and in its spec
``CUDA_DEVICE_MEMORY_LIMIT_0=99999m``, ``CUDA_DEVICE_SM_LIMIT=100``, ``LD_PRELOAD=""``,
``CUDA_DISABLE_CONTROL=true``) and its container ran with the tenant's values.

* envvar mode (the session cluster, the kustomize policies): the API server refuses the pod
  (``test_policies.py``), and with the policy's binding removed the daemon refuses it at
  Allocate: the pod fails admission, nothing is created.
* CDI mode (a cluster of its own, ``--device-list-strategy cdi-cri``, the chart's policies for
  that strategy): the pod runs, and its final env holds the real limits.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
import yaml
from e2e_nodes import CARD_4GIB, cards, gpu_uuid
from kube_cluster import MEMORY, REPO, Cluster, NodeSpec, pod_manifest, running_cluster, wait_for

ISSUE_ENV = [
    {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "99999m"},
    {"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"},
    {"name": "LD_PRELOAD", "value": ""},
    {"name": "CUDA_DISABLE_CONTROL", "value": "true"},
]
CORE = MEMORY.replace("vcuda-memory", "vcuda-core")
POLICY = "admissionregistration.k8s.io/v1"


def _tenant(name: str) -> dict[str, Any]:
    pod = pod_manifest(name, {MEMORY: 4, CORE: 30})
    pod["spec"]["containers"][0]["env"] = ISSUE_ENV
    return pod


def test_envvar_the_daemon_refuses_the_pod_where_the_policy_is_off(cluster: Cluster) -> None:
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
        cluster.create_pod(_tenant("tamper-envvar"))
        pod = cluster.wait_pod("default", "tamper-envvar", "Failed")
        message = (pod.get("status") or {}).get("message", "")
        assert "sets CUDA_DEVICE_MEMORY_LIMIT_0" in message, pod.get("status")
        assert "tamper-envvar" not in {r["pod"] for r in cluster.nodes["node-1"].records()} | {
            r["pod"] for r in cluster.nodes["node-2"].records()
        }
    finally:
        cluster.delete_pod("default", "tamper-envvar")
        cluster.api.apply_all(
            [saved | {"apiVersion": POLICY, "kind": "ValidatingAdmissionPolicyBinding"}]
        )
        cluster.wait_policies_in_force()


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
        gpus = cards(7, CARD_4GIB, 1)
        cdi = c.dir / "node-1" / "cdi"
        cdi.mkdir(parents=True)
        # the cards' own CDI names, as nvidia-ctk or the GPU Operator would write them
        (cdi / "nvidia.com-gpu.json").write_text(
            json.dumps(
                {
                    "cdiVersion": "0.5.0",
                    "kind": "nvidia.com/gpu",
                    "devices": [
                        {"name": g["uuid"], "containerEdits": {"env": ["NVIDIA_SIM_CARD=1"]}}
                        for g in gpus
                    ],
                }
            )
        )
        args = [
            "--device-list-strategy=cdi-cri",
            f"--dra-cdi-dir={cdi}",
            f"--cdi-spec-dirs={cdi}",
        ]
        c.add_node(NodeSpec("node-1", gpus, daemon_args=args))
        yield c


def test_cdi_the_pod_runs_with_its_real_limits_in_the_final_env(cdi_cluster: Cluster) -> None:
    cdi_cluster.create_pod(_tenant("tamper-cdi"))
    try:
        cdi_cluster.wait_pod("default", "tamper-cdi", "Running")
        record = cdi_cluster.wait_record("node-1", "default", "tamper-cdi", "main")
        assert record.get("error") is None, record
        env = record["env"]
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m", env
        assert env["CUDA_DEVICE_SM_LIMIT"] == "30", env
        assert env["LD_PRELOAD"] == "/usr/local/vgpu/libvgpu.so", env
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
        # what the kubelet sent had the tenant's values last: the CDI edits replaced them
        sent = [e["value"] for e in record["cri_env"] if e["name"] == "CUDA_DEVICE_MEMORY_LIMIT_0"]
        assert sent == ["99999m"], record["cri_env"]
        grants = [n for n in record["cdi_applied"] if n.startswith("gpushare.io/grant=")]
        assert len(grants) == 2, record["cdi_applied"]  # the memory grant and the core grant
        assert f"nvidia.com/gpu={gpu_uuid(7, 0)}" in record["cdi_applied"]
        mounts = {m["container_path"] for m in record["mounts"]}
        assert {"/usr/local/vgpu/libvgpu.so", "/usr/local/vgpu/cache", "/tmp/vgpulock"} <= mounts
        assert record["hooks"] == []  # an interposer card: no driver-limit hook
    finally:
        cdi_cluster.delete_pod("default", "tamper-cdi")
