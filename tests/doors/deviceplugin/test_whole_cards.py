"""Whole cards, ``<prefix>/gpu``: one device per card, answered with its UUIDs."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from conftest import H200, TESLA_P4, Node, cards, gpu_uuid

from gpushare._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushare.share.answers import CONTAINER_LIBRARY
from gpushare.sim.kubeletdouble import AdmissionError


def gpu_resource(node: Node) -> str:
    return f"{node.settings.resource_prefix}/gpu"


def start_whole(node: Node, gpus: list[dict[str, Any]], **overrides: Any) -> None:
    node.start(gpus, whole_cards=True, **overrides)
    assert node.kubelet.wait_for(lambda k: bool(k.devices(gpu_resource(node))))


def stub(node: Node) -> api_pb2_grpc.DevicePluginStub:
    socket = node.socket(gpu_resource(node))
    return api_pb2_grpc.DevicePluginStub(grpc.insecure_channel(f"unix://{socket}"))


def test_whole_cards_are_listed_by_uuid_with_their_numa_node(node: Node) -> None:
    start_whole(node, cards(H200, 4))
    devices = node.kubelet.devices(gpu_resource(node))
    assert list(devices) == [gpu_uuid(i) for i in range(4)]
    assert all(d.health == "Healthy" for d in devices.values())
    assert [d.topology.nodes[0].ID for d in devices.values()] == [0, 1, 0, 1]
    (name,) = node.kubelet.registered_names(gpu_resource(node))
    assert name.startswith("gpushare-gpu.") and name.endswith(".sock")
    assert node.socket(gpu_resource(node)).name == name


@pytest.mark.parametrize("size", [2, 4])
def test_a_container_gets_size_cards_named_in_a_stable_order(node: Node, size: int) -> None:
    start_whole(node, cards(H200, 4))
    admitted = node.kubelet.admit("train", "main", {gpu_resource(node): size})
    ids = admitted.devices[gpu_resource(node)]
    assert len(set(ids)) == size
    visible = admitted.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert sorted(visible) == sorted(ids)
    assert visible == sorted(visible, key=lambda u: [gpu_uuid(i) for i in range(4)].index(u))
    # The raw cards: no interposer, no limits.
    assert "LD_PRELOAD" not in admitted.envs
    assert not any(k.startswith("CUDA_DEVICE_") for k in admitted.envs)
    assert admitted.mounts == {}


def test_cards_run_out_and_the_kubelet_says_insufficient(node: Node) -> None:
    start_whole(node, cards(TESLA_P4, 2))
    first = node.kubelet.admit("a", "main", {gpu_resource(node): 1}).card()
    second = node.kubelet.admit("b", "main", {gpu_resource(node): 1}).card()
    assert {first, second} == {gpu_uuid(0), gpu_uuid(1)}
    with pytest.raises(AdmissionError, match="Insufficient"):
        node.kubelet.admit("c", "main", {gpu_resource(node): 1})


def test_exclusive_enforcement_sets_full_limits_per_card(node: Node) -> None:
    start_whole(node, cards(TESLA_P4, 2), exclusive_enforcement=True)
    admitted = node.kubelet.admit("a", "main", {gpu_resource(node): 2})
    assert admitted.envs["LD_PRELOAD"] == CONTAINER_LIBRARY
    assert admitted.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "7611m"
    assert admitted.envs["CUDA_DEVICE_MEMORY_LIMIT_1"] == "7611m"
    assert admitted.envs["CUDA_DEVICE_SM_LIMIT"] == "100"
    assert CONTAINER_LIBRARY in admitted.mounts


@pytest.mark.parametrize(
    ("ids", "text"),
    [
        (["GPU-nope"], "is not a gpu device"),
        ([gpu_uuid(0), gpu_uuid(0)], "listed twice"),
        ([f"{gpu_uuid(0)}::0"], "is not a gpu device"),
        ([], "names no devices"),
    ],
)
def test_allocate_refuses_ids_that_are_not_whole_cards(
    node: Node, ids: list[str], text: str
) -> None:
    start_whole(node, cards(TESLA_P4, 2))
    request = api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
    )
    with pytest.raises(grpc.RpcError) as error:
        stub(node).Allocate(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert text in (error.value.details() or "")
    # Nothing was recorded: both cards are still free.
    assert len(node.kubelet.admit("a", "main", {gpu_resource(node): 2}).card().split(",")) == 2


def test_without_whole_cards_no_gpu_resource_is_registered(node: Node) -> None:
    node.start(cards(TESLA_P4, 1))
    assert gpu_resource(node) not in {r for r, _ in node.kubelet.registrations}
