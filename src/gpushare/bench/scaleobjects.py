"""The objects of ``make scale`` (:mod:`gpushare.bench.scale`): a GPU Node as the API
server sends it (realistic status, 8 A100s in the daemon's card state) and a ~6 KB Pod
(managed fields, env, status), shared by the stand-in list server and the loader of the
real API server (:mod:`gpushare.bench.scaleload`)."""

from __future__ import annotations

import json
from typing import Any

from gpushare.kube import nodestate

PREFIX = "gpushare.io"
CARDS = 8


def card_uuid(node: int, card: int) -> str:
    return f"GPU-{node:05d}-{card:02d}-5f2a-4c3e-9b1d-000000000000"


def node_name(index: int) -> str:
    return f"node-{index:05d}"


def card_state_text(index: int) -> str:
    """The daemon's card state of node ``index`` (``nodestate.encode``): 8 A100s with a
    few pods counted per card."""
    cards = tuple(
        nodestate.CardState(
            uuid=card_uuid(index, c),
            index=c,
            name="NVIDIA A100-SXM4-80GB",
            memory_mib=81920,
            memory_units=320,
            memory_units_used=64 * (c % 4),
            core_units=100,
            core_units_used=25 * (c % 4),
            healthy=True,
            pods=tuple((f"default/pod-{index}-{c}-{p}", 64, 25) for p in range(c % 4)),
        )
        for c in range(CARDS)
    )
    return nodestate.encode(nodestate.NodeGpuState(7, "2026-11-27T05:00:00Z", 256, cards))


def gpu_node(index: int) -> dict[str, Any]:
    """A Node as the API server sends it: labels, a realistic status, and the daemon's
    card state for 8 A100s with a few pods counted per card."""
    name = node_name(index)
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": f"7d1c{index:08d}-0000-4000-8000-000000000000",
            "resourceVersion": "1",
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "node.kubernetes.io/instance-type": "p4d.24xlarge",
                "topology.kubernetes.io/zone": "zone-a",
                f"{PREFIX}/gpu": "true",
            },
            "annotations": {
                nodestate.annotation_key(PREFIX): card_state_text(index),
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
        },
        "spec": {"podCIDR": "10.0.0.0/24", "providerID": f"aws:///zone-a/i-{index:017d}"},
        "status": _node_status(name),
    }


def _node_status(name: str) -> dict[str, Any]:
    """A GPU node's status as its kubelet reports it: 8 A100s in capacity, conditions,
    addresses, versions and 20 images."""
    images = [
        {"names": [f"registry.example.com/team/image-{i}@sha256:{'ab' * 32}"], "sizeBytes": 10**9}
        for i in range(20)
    ]
    amounts = {
        "cpu": "96",
        "memory": "1056561908Ki",
        "pods": "110",
        "ephemeral-storage": "3750000000Ki",
        f"{PREFIX}/vcuda-memory": str(320 * CARDS),
        f"{PREFIX}/vcuda-core": str(100 * CARDS),
    }
    return {
        "capacity": amounts,
        "allocatable": amounts,
        "conditions": [
            {
                "type": kind,
                "status": "False" if kind != "Ready" else "True",
                "lastHeartbeatTime": "2026-11-27T05:00:00Z",
                "lastTransitionTime": "2026-11-20T05:00:00Z",
                "reason": f"Kubelet{kind}",
                "message": f"kubelet reports {kind}",
            }
            for kind in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
        ],
        "addresses": [
            {"type": "InternalIP", "address": "10.0.0.1"},
            {"type": "Hostname", "address": name},
        ],
        "nodeInfo": {
            "kubeletVersion": "v1.36.3",
            "containerRuntimeVersion": "containerd://2.1.0",
            "osImage": "Ubuntu 24.04 LTS",
            "kernelVersion": "6.8.0",
            "architecture": "amd64",
        },
        "images": images,
    }


def a_pod(index: int, gpu: bool, node: str = "", card: str = "") -> dict[str, Any]:
    """A ~6 KB Pod as the API server lists it (managed fields, env, status). A bound GPU
    pod (``card`` given) carries the extender's plan and the daemon's card annotation."""
    name = f"pod-{index:06d}"
    annotations = {"kubectl.kubernetes.io/restartedAt": "2026-11-20T05:00:00Z"}
    if gpu and card:
        annotations[nodestate.plan_annotation_key(PREFIX)] = nodestate.encode_plan({"main": card})
        annotations[nodestate.pod_annotation_key(PREFIX, "main")] = card
    return {
        "metadata": {
            "name": name,
            "namespace": f"team-{index % 50}",
            "uid": f"{index:08d}-1111-4000-8000-000000000000",
            "resourceVersion": str(1000 + index),
            "creationTimestamp": "2026-11-27T05:00:00Z",
            "labels": {"app": f"app-{index % 300}", "pod-template-hash": "5d8f7c9b6d"},
            "annotations": annotations,
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": f"app-{index % 300}",
                    "uid": "0000",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "managedFields": _managed_fields(),
        },
        "spec": _pod_spec(gpu, node),
        "status": _running_status(),
    }


def _managed_fields() -> list[dict[str, Any]]:
    """What the controller manager and the kubelet wrote of a pod (its managed fields)."""
    return [
        {
            "manager": "kube-controller-manager",
            "operation": "Update",
            "apiVersion": "v1",
            "time": "2026-11-27T05:00:00Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": {
                "f:metadata": {"f:labels": {"f:app": {}}},
                "f:spec": {
                    "f:containers": {
                        'k:{"name":"main"}': {
                            ".": {},
                            "f:env": {},
                            "f:image": {},
                            "f:resources": {},
                        }
                    }
                },
            },
        },
        {
            "manager": "kubelet",
            "operation": "Update",
            "apiVersion": "v1",
            "time": "2026-11-27T05:00:01Z",
            "fieldsType": "FieldsV1",
            "subresource": "status",
            "fieldsV1": {
                "f:status": {
                    "f:conditions": {},
                    "f:containerStatuses": {},
                    "f:hostIP": {},
                    "f:phase": {},
                    "f:podIP": {},
                }
            },
        },
    ]


def _pod_spec(gpu: bool, node: str) -> dict[str, Any]:
    """One container with twelve settings in its env, 2 CPUs and 4 GiB (and, ``gpu``,
    16 memory units and 10 core units), bound to ``node``."""
    limits: dict[str, str] = {"cpu": "2", "memory": "4Gi"}
    if gpu:
        limits[f"{PREFIX}/vcuda-memory"] = "16"
        limits[f"{PREFIX}/vcuda-core"] = "10"
    env = [{"name": f"SETTING_{i}", "value": "x" * 40} for i in range(12)]
    return {
        "containers": [
            {
                "name": "main",
                "image": "registry.example.com/team/app:1.2.3",
                "env": env,
                "resources": {"limits": limits, "requests": limits},
                "volumeMounts": [
                    {
                        "name": "kube-api-access",
                        "readOnly": True,
                        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                    }
                ],
                "terminationMessagePath": "/dev/termination-log",
                "imagePullPolicy": "IfNotPresent",
            }
        ],
        "nodeName": node,
        "restartPolicy": "Always",
        "schedulerName": "gpushare-scheduler" if gpu else "default-scheduler",
        "serviceAccountName": "default",
        "tolerations": [
            {
                "key": "node.kubernetes.io/not-ready",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            }
        ],
        "volumes": [
            {
                "name": "kube-api-access",
                "projected": {
                    "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}
                    ]
                },
            }
        ],
    }


def _running_status() -> dict[str, Any]:
    """A running pod's status, its one container started."""
    return {
        "phase": "Running",
        "hostIP": "10.0.0.1",
        "podIP": "10.1.0.1",
        "startTime": "2026-11-27T05:00:00Z",
        "conditions": [
            {"type": t, "status": "True", "lastTransitionTime": "2026-11-27T05:00:00Z"}
            for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
        ],
        "containerStatuses": [
            {
                "name": "main",
                "ready": True,
                "restartCount": 0,
                "image": "registry.example.com/team/app:1.2.3",
                "imageID": f"registry.example.com/team/app@sha256:{'cd' * 32}",
                "containerID": f"containerd://{'ef' * 32}",
                "state": {"running": {"startedAt": "2026-11-27T05:00:01Z"}},
            }
        ],
    }


def pod_template(gpu: bool) -> str:
    """:func:`a_pod` as a %-template of what varies with the index (one json.dumps, not
    one per pod: the stand-in shares the cores with the extender it measures)."""
    pod = a_pod(0, gpu, "@node@", "@card@")
    meta = pod["metadata"]
    meta.update(name="@name@", namespace="@namespace@", uid="@uid@", resourceVersion="@rv@")
    meta["labels"]["app"] = "@app@"
    meta["ownerReferences"][0]["name"] = "@app@"
    text = json.dumps(pod).replace("%", "%%")
    for field in ("node", "card", "name", "namespace", "uid", "rv", "app"):
        text = text.replace(f"@{field}@", f"%({field})s")
    return text


def pod_fields(index: int, nodes: int) -> dict[str, str]:
    """Pod ``index`` of a cluster of ``nodes`` nodes: bound to node ``index % nodes``,
    on its card ``index % 8``."""
    node = index % max(nodes, 1)
    return {
        "node": node_name(node),
        "card": card_uuid(node, (index // max(nodes, 1)) % CARDS),
        "name": f"pod-{index:06d}",
        "namespace": f"team-{index % 50}",
        "uid": f"{index:08d}-1111-4000-8000-000000000000",
        "rv": str(1000 + index),
        "app": f"app-{index % 300}",
    }


POD_TEXT = {gpu: pod_template(gpu) for gpu in (False, True)}


def pending_pod(index: int, memory_units: int = 16) -> dict[str, Any]:
    pod = a_pod(index, gpu=True)
    pod["status"] = {"phase": "Pending"}
    pod["metadata"]["annotations"] = {}
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    limits[f"{PREFIX}/vcuda-memory"] = str(memory_units)
    return pod
