"""Sequences a hostile review found that could split a container or wedge the records.

Each ran against the code before its fix and split a container (or wedged the
PodResources client); each must now end with the container on one card or refused.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from conftest import TESLA_P4, Node, cards
from kit.mig_layouts import reference_a100
from kit.pairing_world import CORE, MEMORY, REGIMES, World, _Context, pod_object

from gpushare._proto.deviceplugin.v1beta1 import api_pb2
from gpushare.deviceplugin.exclusive import ExclusiveServicer
from gpushare.gpu.gpus import Gpu
from gpushare.gpu.health import HealthBoard
from gpushare.node.podresources import PodResourcesClient
from gpushare.share.whole import whole_cards
from gpushare.sim.kubeletdouble import AdmissionError, ContainerSpec

FACTS = REGIMES[2]  # PodResources and pod specs


def one_card(
    world: World, pod: str, container: str, requests: dict[str, int], **kw: object
) -> None:
    try:
        record = world.kubelet.admit(pod, container, requests, **kw)  # type: ignore[arg-type]
    except AdmissionError:
        return  # refused: allowed, never split
    cards = {d.split("::")[0] for ids in record.devices.values() for d in ids}
    assert len(cards) == 1 and not record.conflicts, (record.devices, record.conflicts)


def test_a_dead_copy_of_a_pod_with_the_same_name_is_not_its_spec() -> None:
    """'web' deleted and created again with cores added; the watch still shows the old
    one (Running): its spec must not decide that the new one wants no cores."""
    world = World((1024, 1024), FACTS)
    world.admit([({MEMORY: 1}, (MEMORY,))])
    old = pod_object("web", [ContainerSpec("c0", {MEMORY: 1})])
    old["metadata"]["uid"] = "uid-old"
    old["status"]["phase"] = "Running"
    assert world.specs is not None
    world.specs.update(old)
    world.api_up = False
    one_card(world, "web", "c0", {MEMORY: 1, CORE: 10}, order=(MEMORY, CORE))


def test_an_unknown_pod_is_not_proof_that_no_init_container_waits() -> None:
    """An init container's pod missing from the book, and the API server unreachable:
    the binding the records do not list may be that init container's."""
    for api_up in (False, True):
        world = World((1024, 1024), FACTS)
        world.admit([({MEMORY: 1}, (MEMORY,))])
        world.api_up = api_up
        if api_up:  # in the API server, not yet in the book: the re-read finds it
            world.api_pods["p2"] = pod_object(
                "p2", [ContainerSpec("init", {MEMORY: 1, CORE: 10}, init=True)]
            )
        one_card(world, "p2", "init", {MEMORY: 1, CORE: 10}, order=(MEMORY, CORE), init=True)


def test_a_slow_first_allocate_does_not_outlast_the_facts() -> None:
    """A stall longer than the window between a binding and the next request: the
    records and the spec still say which container is asking."""
    world = World((1024, 1024), FACTS)
    world.admit([({MEMORY: 1}, (MEMORY,))])

    def stall(*_args: object) -> None:
        world.now += 11.0

    world.binder._on_allocated = stall  # the edge: a stuck disk, a starved CPU
    outcome = world.admit([({MEMORY: 1, CORE: 10}, (MEMORY, CORE))])
    assert outcome.split == 0, outcome.details


def test_whole_cards_are_preferred_as_the_board_says_not_as_an_old_offer() -> None:
    gpus = [Gpu(uuid=f"GPU-{i}", name="T", memory_mib=1024, index=i, minor=i) for i in range(2)]
    resource = whole_cards(gpus)
    ids = list(resource.devices)
    board = HealthBoard(dict.fromkeys(ids))
    board.set(ids[0], False, "its card has shared units in use")
    servicer = ExclusiveServicer(
        resource, "gpushare.io/gpu", board, threading.Event(), answer=lambda _devices: None
    )
    request = api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=1)
        ]
    )
    answer = servicer.GetPreferredAllocation(request, _Context())
    assert list(answer.container_responses[0].deviceIDs) == [ids[1]]


def test_an_unexpected_error_reading_the_records_does_not_wedge_the_client() -> None:
    # A name too long for the file system: os.stat raises an error Path.exists passes on.
    client = PodResourcesClient(Path("/tmp") / ("x" * 300) / "kubelet.sock", {})
    assert client.read_after(client._clock(), timeout=0.1) is None
    assert "File name too long" in client.last_error
    assert client._inflight is None  # the next read starts its own call
    assert client.read_after(client._clock(), timeout=0.1) is None


@pytest.mark.parametrize("whole_first", [True, False])
def test_a_container_mixing_whole_cards_and_shared_units_is_refused(
    node: Node, whole_first: bool
) -> None:
    """With the pod specs and the records the daemon sees the container hold one kind
    and ask for the other: it refuses instead of naming two cards."""
    node.with_pod_specs()
    node.start(cards(TESLA_P4, 2), whole_cards=True)
    whole = f"{node.settings.resource_prefix}/gpu"
    assert node.kubelet.wait_for(lambda k: bool(k.devices(whole)))
    requests = {whole: 1, node.memory: 4}
    node.pod("mix", requests)
    order = [whole, node.memory] if whole_first else [node.memory, whole]
    with pytest.raises(AdmissionError, match="together with whole cards or MIG"):
        node.kubelet.admit("mix", "main", requests, order=order)
    # A pod of one kind per container is served.
    node.pod("ok", {node.memory: 4})
    assert node.kubelet.admit("ok", "main", {node.memory: 4}).card()


@pytest.mark.parametrize("nvidia_names", [False, True])
@pytest.mark.parametrize("mig_first", [True, False])
def test_shared_units_with_a_mig_device_are_refused(
    node: Node, mig_first: bool, nvidia_names: bool
) -> None:
    """Whichever resource the kubelet asks first, and with ``migNvidiaNames`` (MIG devices
    named ``nvidia.com/mig-*``) too: a container asking a MIG device and shared units is
    refused, never given two GPUs."""
    node.with_pod_specs()
    node.start(
        [reference_a100(), cards(TESLA_P4, 2)[1]],
        mig_strategy="mixed",
        mig_nvidia_names=nvidia_names,
    )
    prefix = "nvidia.com" if nvidia_names else node.settings.resource_prefix
    mig = f"{prefix}/mig-1g.5gb"
    assert node.kubelet.wait_for(lambda k: bool(k.devices(mig)))
    requests = {mig: 1, node.memory: 4}
    node.pod("mix", requests)
    order = [mig, node.memory] if mig_first else [node.memory, mig]
    with pytest.raises(AdmissionError, match="together with whole cards or MIG"):
        node.kubelet.admit("mix", "main", requests, order=order)
    node.pod("ok", {mig: 1})
    assert node.kubelet.admit("ok", "main", {mig: 1}).devices[mig]
