"""Placement and Allocate answers, driven the way the kubelet drives them."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from conftest import CARD_4GIB, RTX_3090, TESLA_P4, Node, cards, gpu_uuid

from gpushare._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushare.host.library import LOCK_DIR_NAME, cache_root
from gpushare.share.answers import (
    CONTAINER_CACHE_DIR,
    CONTAINER_CACHE_FILE,
    CONTAINER_LIBRARY,
    LOCK_DIR,
)
from gpushare.share.devices import Resource
from gpushare.sim.kubeletdouble import AdmissionError


def per_card(node: Node, resource: str) -> dict[str, int]:
    used: dict[str, int] = {}
    for device_id in node.kubelet.allocated(resource):
        uuid = device_id.split("::")[0]
        used[uuid] = used.get(uuid, 0) + 1
    return used


# ------------------------------------------------------------ the reference cases


def test_rtx_3090_holds_50_40_1_and_not_ten_more(node: Node) -> None:
    node.start(cards(RTX_3090, 1))
    for pod, units in (("a", 50), ("b", 40), ("c", 1)):
        node.kubelet.admit(pod, "main", {node.memory: units})
    assert per_card(node, node.memory) == {gpu_uuid(0): 91}  # 23296 MiB
    with pytest.raises(AdmissionError, match=f"Insufficient {node.memory}"):
        node.kubelet.admit("d", "main", {node.memory: 10})


@pytest.mark.parametrize("core_first", [True, False])
def test_two_tesla_p4_take_4_20_20_each_container_on_one_card(node: Node, core_first: bool) -> None:
    node.start(cards(TESLA_P4, 2))
    placed = {}
    for pod, memory, core in (("a", 4, 10), ("b", 20, 30), ("c", 20, 30)):
        order = [node.core, node.memory] if core_first else [node.memory, node.core]
        admitted = node.kubelet.admit(
            pod, "main", {node.memory: memory, node.core: core}, order=order
        )
        assert admitted.conflicts == []
        cards_of_ids = {d.split("::")[0] for ids in admitted.devices.values() for d in ids}
        assert cards_of_ids == {admitted.card()}  # one card for both resources
        placed[pod] = admitted.card()
    assert placed["b"] != placed["c"]  # two 20s cannot share a 29-unit card
    holdings = sorted(
        sorted(n for p, n in (("a", 4), ("b", 20), ("c", 20)) if placed[p] == card)
        for card in set(placed.values())
    )
    assert holdings == [[4, 20], [20]]


def test_two_4gib_cards_pack_2_and_2_but_split_2_and_3(node: Node) -> None:
    node.start(cards(CARD_4GIB, 2))
    first = node.kubelet.admit("a", "main", {node.memory: 8}).card()
    assert node.kubelet.admit("b", "main", {node.memory: 8}).card() == first  # binpack
    node.kubelet.release_all(["a", "b"])
    first = node.kubelet.admit("c", "main", {node.memory: 8}).card()
    assert node.kubelet.admit("d", "main", {node.memory: 12}).card() != first


def test_spread_puts_each_container_on_the_emptiest_card(node: Node) -> None:
    node.start(cards(CARD_4GIB, 2), placement="spread")
    first = node.kubelet.admit("a", "main", {node.memory: 2}).card()
    second = node.kubelet.admit("b", "main", {node.memory: 2}).card()
    third = node.kubelet.admit("c", "main", {node.memory: 1}).card()
    assert first != second and third in (first, second)
    assert per_card(node, node.memory) in (
        {gpu_uuid(0): 3, gpu_uuid(1): 2},
        {gpu_uuid(0): 2, gpu_uuid(1): 3},
    )


def test_binpack_fills_the_fullest_card_that_fits(node: Node) -> None:
    node.start(cards(TESLA_P4, 3))
    node.kubelet.admit("a", "main", {node.memory: 10})
    card_a = node.kubelet.admitted[("default", "a", "main")].card()
    assert node.kubelet.admit("b", "main", {node.memory: 15}).card() == card_a
    assert node.kubelet.admit("c", "main", {node.memory: 10}).card() != card_a  # 4 left there
    assert node.kubelet.admit("d", "main", {node.memory: 4}).card() == card_a


# ------------------------------------------------------------ pairing of resources


@pytest.mark.parametrize("core_first", [True, False])
def test_memory_only_then_core_and_memory_with_pod_specs(node: Node, core_first: bool) -> None:
    """With the pod specs known, a pair after a single-resource container is placed right."""
    node.with_pod_specs()
    node.start(cards(CARD_4GIB, 2))
    node.pod("a", {node.memory: 10})
    a = node.kubelet.admit("a", "main", {node.memory: 10})
    node.pod("b", {node.memory: 10, node.core: 50})
    order = [node.core, node.memory] if core_first else [node.memory, node.core]
    b = node.kubelet.admit("b", "main", {node.memory: 10, node.core: 50}, order=order)
    assert b.card() != a.card()  # only the other card has 10 free memory units
    assert {d.split("::")[0] for ids in b.devices.values() for d in ids} == {b.card()}
    assert b.conflicts == []
    node.pod("c", {node.core: 30, node.memory: 1})
    c = node.kubelet.admit(
        "c", "main", {node.core: 30, node.memory: 1}, order=[node.core, node.memory]
    )
    assert c.envs["CUDA_DEVICE_SM_LIMIT"] == "30" and c.conflicts == []


@pytest.mark.parametrize("core_first", [True, False])
def test_memory_only_then_core_and_memory_never_splits(node: Node, core_first: bool) -> None:
    """Without pod specs the plugin cannot tell whose request it is; it never splits."""
    node.start(cards(CARD_4GIB, 2))
    a = node.kubelet.admit("a", "main", {node.memory: 10})
    order = [node.core, node.memory] if core_first else [node.memory, node.core]
    try:
        b = node.kubelet.admit("b", "main", {node.memory: 10, node.core: 50}, order=order)
    except AdmissionError as refused:
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "no single card holds both" in refused.message
        assert core_first  # memory first is always placed right
        return
    assert b.card() != a.card()
    assert {d.split("::")[0] for ids in b.devices.values() for d in ids} == {b.card()}


def fits_somewhere(node: Node, memory: int, core: int) -> bool:
    free_memory, free_core = per_card(node, node.memory), per_card(node, node.core)
    assert node.daemon is not None and node.daemon.core.inventory is not None
    return any(
        card.memory_units - free_memory.get(card.uuid, 0) >= memory
        and 100 - free_core.get(card.uuid, 0) >= core
        for card in node.daemon.core.inventory.cards.values()
    )


@pytest.mark.parametrize("core_first", [True, False])
def test_pairs_back_to_back_share_a_card_or_are_refused_only_when_nothing_fits(
    node: Node, core_first: bool
) -> None:
    node.start(cards(TESLA_P4, 3))
    order = [node.core, node.memory] if core_first else [node.memory, node.core]
    sizes = [(3, 10), (20, 5), (9, 40), (15, 30), (1, 1), (12, 60), (8, 8), (5, 20), (4, 35)]
    admitted_count = 0
    for i, (memory, core) in enumerate(sizes):
        feasible = fits_somewhere(node, memory, core)
        try:
            admitted = node.kubelet.admit(
                f"p{i}", "main", {node.memory: memory, node.core: core}, order=order
            )
        except AdmissionError as refused:
            assert not feasible, refused
            assert "no single card" in refused.message
            continue
        admitted_count += 1
        assert {d.split("::")[0] for ids in admitted.devices.values() for d in ids} == {
            admitted.card()
        }
        assert admitted.conflicts == []
    assert admitted_count >= 7


def test_core_first_picks_the_card_with_memory_room_for_what_follows(node: Node) -> None:
    """Cores are free everywhere, memory is not: core binpack alone would pick wrongly."""
    node.start(cards(CARD_4GIB, 2))
    node.kubelet.admit(
        "big", "main", {node.memory: 14, node.core: 10}, order=[node.memory, node.core]
    )
    full = node.kubelet.admitted[("default", "big", "main")].card()
    b = node.kubelet.admit(
        "b", "main", {node.memory: 6, node.core: 5}, order=[node.core, node.memory]
    )
    assert b.card() != full


def test_core_only_container_gets_sm_limit_and_no_memory_limit(node: Node) -> None:
    node.start(cards(TESLA_P4, 2))
    admitted = node.kubelet.admit("a", "main", {node.core: 25})
    assert admitted.envs["CUDA_DEVICE_SM_LIMIT"] == "25"
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in admitted.envs
    assert admitted.envs["LD_PRELOAD"] == CONTAINER_LIBRARY
    assert admitted.envs["NVIDIA_VISIBLE_DEVICES"] in (gpu_uuid(0), gpu_uuid(1))


def test_no_single_card_holding_both_is_refused_clearly(node: Node) -> None:
    node.start(cards(CARD_4GIB, 2))
    node.kubelet.admit(
        "a", "main", {node.memory: 12, node.core: 10}, order=[node.memory, node.core]
    )
    node.kubelet.admit("b", "main", {node.core: 95})  # the other card's cores are nearly gone
    with pytest.raises(AdmissionError) as refused:
        node.kubelet.admit(
            "c", "main", {node.memory: 8, node.core: 10}, order=[node.core, node.memory]
        )
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no single card holds both" in refused.value.message


# ------------------------------------------------------------ the answers


def test_memory_answer_holds_every_env_and_mount(node: Node) -> None:
    node.start(cards(TESLA_P4, 1))
    admitted = node.kubelet.admit("a", "main", {node.memory: 4})
    response = admitted.responses[node.memory]
    assert dict(response.envs) == {
        "NVIDIA_VISIBLE_DEVICES": gpu_uuid(0),
        "CUDA_DEVICE_MEMORY_LIMIT_0": "1024m",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": CONTAINER_CACHE_FILE,
        "LD_PRELOAD": CONTAINER_LIBRARY,
    }
    mounts = {m.container_path: (m.host_path, m.read_only) for m in response.mounts}
    library_host, library_ro = mounts[CONTAINER_LIBRARY]
    assert library_ro and Path(library_host).name.startswith("libvgpu.so.")
    assert Path(library_host).read_bytes() == node.library.read_bytes()
    assert Path(library_host).parent == Path(node.settings.host_lib_dir)
    lock_host = cache_root(Path(node.settings.host_lib_dir)) / LOCK_DIR_NAME  # docs/security.md
    assert mounts[LOCK_DIR] == (str(lock_host), False)
    cache_host, cache_ro = mounts[CONTAINER_CACHE_DIR]
    assert not cache_ro and Path(cache_host).is_dir() and list(Path(cache_host).iterdir()) == []
    assert Path(cache_host).stat().st_mode & 0o777 == 0o777
    assert set(mounts) == {CONTAINER_LIBRARY, LOCK_DIR, CONTAINER_CACHE_DIR}


def test_every_container_gets_a_fresh_cache_directory(node: Node) -> None:
    node.start(cards(TESLA_P4, 1))
    first = node.kubelet.admit("a", "main", {node.memory: 4})
    cache = Path(first.mounts[CONTAINER_CACHE_DIR].host_path)
    (cache / "vgpu.cache").write_bytes(b"old accounting")
    second = node.kubelet.admit("b", "main", {node.memory: 4})
    assert second.mounts[CONTAINER_CACHE_DIR].host_path != str(cache)
    node.kubelet.release("a")
    third = node.kubelet.admit("c", "main", {node.memory: 4})  # gets a's units back
    assert third.devices[node.memory] == first.devices[node.memory]
    assert list(Path(third.mounts[CONTAINER_CACHE_DIR].host_path).iterdir()) == []


@pytest.mark.parametrize(
    "mode,env,file", [("env", True, False), ("file", False, True), ("both", True, True)]
)
def test_preload_modes(node: Node, mode: str, env: bool, file: bool) -> None:
    node.start(cards(TESLA_P4, 1), preload=mode)
    admitted = node.kubelet.admit("a", "main", {node.memory: 1})
    assert ("LD_PRELOAD" in admitted.envs) is env
    assert ("/etc/ld.so.preload" in admitted.mounts) is file
    if file:
        mount = admitted.mounts["/etc/ld.so.preload"]
        assert mount.read_only
        assert Path(mount.host_path).read_text() == CONTAINER_LIBRARY + "\n"


def test_no_enforcement_passes_limits_and_warns_in_annotations(node: Node) -> None:
    node.start(cards(TESLA_P4, 1), no_enforcement=True, library="/nonexistent")
    admitted = node.kubelet.admit("a", "main", {node.memory: 2, node.core: 20})
    assert admitted.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "512m"
    assert admitted.envs["CUDA_DEVICE_SM_LIMIT"] == "20"
    assert "LD_PRELOAD" not in admitted.envs and admitted.mounts == {}
    for response in admitted.responses.values():
        assert "--no-enforcement" in response.annotations["gpushare.io/enforcement"]


def test_both_answers_of_a_container_merge_without_conflict(node: Node) -> None:
    node.start(cards(TESLA_P4, 2), preload="both")
    admitted = node.kubelet.admit("a", "main", {node.memory: 3, node.core: 40})
    assert admitted.conflicts == []
    assert admitted.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "768m"
    assert admitted.envs["CUDA_DEVICE_SM_LIMIT"] == "40"


# ------------------------------------------------------------ bad requests


@pytest.fixture
def stubs(node: Node) -> dict[Resource, api_pb2_grpc.DevicePluginStub]:
    node.start(cards(TESLA_P4, 2))
    return {
        resource: api_pb2_grpc.DevicePluginStub(
            grpc.insecure_channel(
                f"unix://{node.socket(resource.name_with(node.settings.resource_prefix))}"
            )
        )
        for resource in Resource
    }


def allocate(stub: api_pb2_grpc.DevicePluginStub, *groups: list[str]) -> api_pb2.AllocateResponse:
    return stub.Allocate(
        api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in groups]
        ),
        timeout=30,
    )


@pytest.mark.parametrize(
    "ids,code,text",
    [
        (["GPU-nope::1"], grpc.StatusCode.INVALID_ARGUMENT, "names no GPU"),
        (["garbage"], grpc.StatusCode.INVALID_ARGUMENT, "not a gpushare device ID"),
        ([f"{gpu_uuid(0)}::50"], grpc.StatusCode.INVALID_ARGUMENT, "not a vcuda-memory unit"),
        ([f"{gpu_uuid(0)}::1", f"{gpu_uuid(0)}::1"], grpc.StatusCode.INVALID_ARGUMENT, "twice"),
        ([], grpc.StatusCode.INVALID_ARGUMENT, "names no devices"),
        (
            [f"{gpu_uuid(0)}::1", f"{gpu_uuid(1)}::1"],
            grpc.StatusCode.FAILED_PRECONDITION,
            f"GPU0 ({gpu_uuid(0)}): 1 units, GPU1 ({gpu_uuid(1)}): 1 units",
        ),
    ],
)
def test_bad_allocate_requests_get_a_status_and_the_daemon_goes_on(
    stubs: dict[Resource, api_pb2_grpc.DevicePluginStub],
    ids: list[str],
    code: grpc.StatusCode,
    text: str,
) -> None:
    with pytest.raises(grpc.RpcError) as error:
        allocate(stubs[Resource.MEMORY], ids)
    assert error.value.code() == code
    assert text in error.value.details()
    ok = allocate(stubs[Resource.MEMORY], [f"{gpu_uuid(1)}::3"])
    assert ok.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == gpu_uuid(1)


def test_an_empty_allocate_request_is_invalid(
    stubs: dict[Resource, api_pb2_grpc.DevicePluginStub],
) -> None:
    with pytest.raises(grpc.RpcError) as error:
        allocate(stubs[Resource.CORE])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_an_unhealthy_card_is_refused(
    node: Node, stubs: dict[Resource, api_pb2_grpc.DevicePluginStub]
) -> None:
    assert node.daemon is not None and node.daemon.core.health is not None
    node.daemon.core.health.set(gpu_uuid(1), False, "XID 79")
    with pytest.raises(grpc.RpcError) as error:
        allocate(stubs[Resource.CORE], [f"{gpu_uuid(1)}::0"])
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "GPU1" in error.value.details() and "XID 79" in error.value.details()


def test_preferred_allocation_validates_its_input(
    stubs: dict[Resource, api_pb2_grpc.DevicePluginStub],
) -> None:
    stub = stubs[Resource.MEMORY]

    def prefer(available: list[str], size: int, must: list[str] | None = None) -> list[str]:
        reply = stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available,
                        must_include_deviceIDs=must or [],
                        allocation_size=size,
                    )
                ]
            ),
            timeout=30,
        )
        return list(reply.container_responses[0].deviceIDs)

    ids0 = [f"{gpu_uuid(0)}::{n}" for n in range(5)]
    ids1 = [f"{gpu_uuid(1)}::{n}" for n in range(3)]
    assert prefer(ids0 + ids1, 3) == [f"{gpu_uuid(1)}::{n}" for n in range(3)]  # binpack
    assert prefer(ids0 + ids1, 2, must=[ids0[4]]) == [ids0[4], ids0[0]]
    for available, size in ((ids0, 0), (ids0, 6), (["bad"], 1)):
        with pytest.raises(grpc.RpcError) as error:
            prefer(available, size)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as error:
        prefer(ids0, 1, must=[ids1[0]])
    assert "must_include" in error.value.details()
