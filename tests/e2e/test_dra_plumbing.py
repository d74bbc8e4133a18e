"""The DRA pieces a gpushare DRA driver will stand on, checked on this cluster before there is
a driver: resource.k8s.io/v1 with consumable capacity kept as written, node-scoped slices, the
resourceclaim controller turning a ResourceClaimTemplate into a claim, and the scheduler
allocating a share of a device's capacity (consumedCapacity). No driver runs: the kubelet
cannot prepare the claim and the pod stays Pending, which is not checked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kube_cluster import Api, Cluster, wait_for

DRIVER = "gpu.gpushare.io"
CLASS = "e2e-gpushare-share"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def device_slice(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"e2e-{node}-{DRIVER}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "allowMultipleAllocations": True,
                    "attributes": {"uuid": {"string": "GPU-e2e-0"}},
                    "capacity": {
                        "memory": {
                            "value": "8Gi",
                            "requestPolicy": {
                                "default": "1Gi",
                                "validRange": {"min": "256Mi", "step": "256Mi"},
                            },
                        },
                        "cores": {
                            "value": "100",
                            "requestPolicy": {
                                "default": "100",
                                "validRange": {"min": "1", "max": "100", "step": "1"},
                            },
                        },
                    },
                }
            ],
        },
    }


@pytest.fixture
def node1_api(cluster: Cluster) -> Api:
    """node-1's kubelet credentials (system:node:node-1), as a DRA driver's kubelet plugin
    helper would publish slices."""
    return cluster.api.as_token(cluster.node_tokens["node-1"])


@pytest.fixture
def dra_objects(cluster: Cluster) -> Iterator[None]:
    yield
    cluster.delete_pod("default", "dra-pod")
    for path in (
        "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates/dra-share",
        f"/apis/resource.k8s.io/v1/deviceclasses/{CLASS}",
        f"{SLICES}/e2e-node-1-{DRIVER}",
        f"{SLICES}/e2e-node-2-{DRIVER}",
    ):
        cluster.api.delete(path)


def test_a_template_becomes_a_claim_allocated_a_share_of_a_device(
    cluster: Cluster, node1_api: Api, dra_objects: None
) -> None:
    # The node may publish its own slice, not another node's.
    reply = node1_api.create(device_slice("node-2"))
    assert reply.status_code == 403, reply.text
    reply = node1_api.create(device_slice("node-1"))
    assert reply.status_code == 201, reply.text
    # The gates are on: the API server kept what an off gate silently drops.
    stored = cluster.api.get(f"{SLICES}/e2e-node-1-{DRIVER}")["spec"]["devices"][0]
    assert stored["allowMultipleAllocations"] is True
    assert stored["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "256Mi"

    cluster.api.apply_all(
        [
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": CLASS},
                "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
            },
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": "dra-share", "namespace": "default"},
                "spec": {
                    "spec": {
                        "devices": {
                            "requests": [
                                {
                                    "name": "gpu",
                                    "exactly": {
                                        "deviceClassName": CLASS,
                                        "capacity": {
                                            "requests": {"memory": "3000Mi", "cores": "40"}
                                        },
                                    },
                                }
                            ]
                        }
                    }
                },
            },
        ]
    )
    cluster.create_pod(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "dra-pod", "namespace": "default"},
            "spec": {
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": 0,
                "tolerations": [{"operator": "Exists"}],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "dra-share"}],
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
            },
        }
    )

    def claim_name() -> str | None:
        pod = cluster.pod("default", "dra-pod") or {}
        for status in pod.get("status", {}).get("resourceClaimStatuses", []):
            if status.get("resourceClaimName"):
                return str(status["resourceClaimName"])
        return None

    name = wait_for("the resourceclaim controller to make the claim", claim_name, 60)
    path = f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}"

    def allocation() -> dict[str, Any] | None:
        claim = cluster.api.get(path)
        return claim.get("status", {}).get("allocation")  # type: ignore[no-any-return]

    result = wait_for("the scheduler to allocate the claim", allocation, 60)
    (device,) = result["devices"]["results"]
    assert (device["driver"], device["pool"], device["device"]) == (DRIVER, "node-1", "gpu-0")
    # 3000Mi rounded up to the 256Mi step: 12 x 256Mi = 3Gi.
    assert device["consumedCapacity"] == {"memory": "3Gi", "cores": "40"}
    assert device.get("shareID")
    pod = wait_for(
        "the pod to be bound",
        lambda: (cluster.pod("default", "dra-pod") or {}).get("spec", {}).get("nodeName"),
        60,
    )
    assert pod == "node-1"
