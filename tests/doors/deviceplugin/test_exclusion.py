"""Exclusive and shared on one node, never on one card at once (docs/modes.md).

Driven by the kubelet stand-in over real sockets: the kubelet offers only what the
plugin lists Healthy, so the exclusion shows as device lists; the race (a kubelet
acting on an older list) is driven by calling Allocate directly.
"""

from __future__ import annotations

import itertools
from typing import Any

import grpc
import pytest
from conftest import TESLA_P4, Node, cards, gpu_uuid
from kit.procs import poll

from gpushare._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushare.base.startup import NodeConfigurationError
from gpushare.daemon import Daemon
from gpushare.share.cardmodes import CardMode, parse_card_modes
from gpushare.share.devices import format_device_id
from gpushare.sim.kubeletdouble import AdmissionError

UNITS = 29  # memory units of a Tesla P4


def gpu(node: Node) -> str:
    return f"{node.settings.resource_prefix}/gpu"


def card_of(device_id: str) -> str:
    return device_id.split("::")[0]


def held_both_ways(node: Node) -> set[str]:
    """Cards the kubelet has given out whole AND as shared units: must stay empty."""
    whole = set(node.kubelet.allocated(gpu(node)))
    shared = {card_of(d) for r in (node.memory, node.core) for d in node.kubelet.allocated(r)}
    return whole & shared


def healthy(node: Node, resource: str, card: str) -> int:
    return sum(
        1
        for device_id, d in node.kubelet.devices(resource).items()
        if card_of(device_id) == card and d.health == "Healthy"
    )


def seen(node: Node, expected: dict[tuple[str, str], int]) -> bool:
    """Wait until the kubelet's lists show ``expected`` (resource, card) -> healthy count,
    re-reading the kubelet's records meanwhile (a release is seen in PodResources)."""

    def matches() -> bool:
        return all(healthy(node, r, c) == n for (r, c), n in expected.items())

    def refreshed() -> bool:
        assert node.daemon is not None and node.daemon.core.refresher is not None
        if matches():
            return True
        node.daemon.core.refresher.refresh_once()
        return node.kubelet.wait_for(lambda _k: matches(), 0.05)

    return poll(refreshed, 30.0)


def start(node: Node, count: int = 1, **overrides: Any) -> None:
    node.start(cards(TESLA_P4, count), whole_cards=True, **overrides)
    assert node.kubelet.wait_for(lambda k: bool(k.devices(gpu(node))))


def restart_daemon(node: Node) -> None:
    assert node.daemon is not None
    count = len(node.kubelet.registrations)
    node.daemon.stop()
    node.daemon = Daemon(node.settings, specs=node.specs)
    node.daemon.start()
    assert node.kubelet.wait_for(lambda k: len(k.registrations) >= count + 3, 30.0)


# ------------------------------------------------------------------ the two directions


def test_shared_units_in_use_take_the_card_off_the_whole_card_list(node: Node) -> None:
    start(node, 2)
    shared = node.kubelet.admit("notebook", "main", {node.memory: 4}).card()
    other = next(u for u in (gpu_uuid(0), gpu_uuid(1)) if u != shared)
    assert seen(node, {(gpu(node), shared): 0, (gpu(node), other): 1})
    with pytest.raises(AdmissionError, match="Insufficient"):
        node.kubelet.admit("train", "main", {gpu(node): 2})
    assert node.kubelet.admit("train", "main", {gpu(node): 1}).card() == other
    # now the other card is held whole: its shared units are off the list
    assert seen(node, {(node.memory, other): 0, (node.core, other): 0})
    assert seen(node, {(node.memory, shared): UNITS})  # held units stay listed
    assert node.kubelet.admit("nb2", "main", {node.memory: 4, node.core: 10}).card() == shared
    assert held_both_ways(node) == set()


def test_a_card_held_whole_offers_no_shared_units_until_released(node: Node) -> None:
    start(node, 1)
    node.kubelet.admit("train", "main", {gpu(node): 1})
    card = gpu_uuid(0)
    assert seen(node, {(node.memory, card): 0, (node.core, card): 0})
    with pytest.raises(AdmissionError, match="Insufficient"):
        node.kubelet.admit("notebook", "main", {node.memory: 1})
    node.kubelet.release("train")
    assert seen(node, {(node.memory, card): UNITS, (node.core, card): 100, (gpu(node), card): 1})
    assert node.kubelet.admit("notebook", "main", {node.memory: 1}).card() == card
    assert seen(node, {(gpu(node), card): 0})


# ------------------------------------------------------------------ races


def allocate(node: Node, resource: str, ids: list[str]) -> api_pb2.AllocateResponse:
    channel = grpc.insecure_channel(f"unix://{node.socket(resource)}")
    with channel:
        return api_pb2_grpc.DevicePluginStub(channel).Allocate(
            api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
            ),
            timeout=30,
        )


def test_allocate_refuses_a_card_taken_the_other_way_from_a_stale_list(node: Node) -> None:
    start(node, 1)
    card = gpu_uuid(0)
    allocate(node, node.memory, [format_device_id(card, 0)])
    with pytest.raises(grpc.RpcError) as error:
        allocate(node, gpu(node), [card])
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "shared units in use" in (error.value.details() or "")


def test_allocate_refuses_shared_units_of_a_card_held_whole(node: Node) -> None:
    start(node, 1)
    card = gpu_uuid(0)
    allocate(node, gpu(node), [card])
    with pytest.raises(grpc.RpcError) as error:
        allocate(node, node.core, [format_device_id(card, 0)])
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "in use whole" in (error.value.details() or "")


# ------------------------------------------------------------------ every order


OPS = ("shared", "whole", "release-shared", "release-whole", "restart")


def orders() -> list[tuple[str, ...]]:
    """Every order of the five steps in which a release follows its admission."""
    return [
        order
        for order in itertools.permutations(OPS)
        if order.index("shared") < order.index("release-shared")
        and order.index("whole") < order.index("release-whole")
    ]


def expected_lists(node: Node, shared: bool, whole: bool) -> dict[tuple[str, str], int]:
    card = gpu_uuid(0)
    return {
        (gpu(node), card): 0 if shared else 1,
        (node.memory, card): 0 if whole else UNITS,
    }


ALL_ORDERS = orders()
#: By default the first order with the restart in each position; all 30 with ``-m slow``.
SOME_ORDERS = [next(o for o in ALL_ORDERS if o.index("restart") == i) for i in range(5)]


def test_the_orders_are_all_there() -> None:
    assert len(ALL_ORDERS) == 30 and len(set(ALL_ORDERS)) == 30
    assert {order.index("restart") for order in SOME_ORDERS} == set(range(5))


@pytest.mark.parametrize(
    "chosen",
    [
        pytest.param(SOME_ORDERS, id="some"),
        pytest.param(
            ALL_ORDERS,
            id="all",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_every_order_of_admissions_releases_and_a_restart(
    node: Node, chosen: list[tuple[str, ...]]
) -> None:
    """One card; the kubelet's lists must follow the model after every step, an
    admission must succeed exactly when the card is free of the other kind, and the
    kubelet must never hold the card both ways."""
    start(node, 1)
    for number, order in enumerate(chosen):
        shared = whole = False
        for step in order:
            if step == "shared":
                try:
                    node.kubelet.admit(f"s{number}", "main", {node.memory: 1})
                    shared = True
                except AdmissionError:
                    assert whole, f"{order}: shared refused on a card not held whole"
                else:
                    assert not whole, f"{order}: shared admitted on a card held whole"
            elif step == "whole":
                try:
                    node.kubelet.admit(f"w{number}", "main", {gpu(node): 1})
                    whole = True
                except AdmissionError:
                    assert shared, f"{order}: whole refused on a card without shared use"
                else:
                    assert not shared, f"{order}: whole admitted beside shared units"
            elif step == "release-shared":
                node.kubelet.release(f"s{number}")
                shared = False
            elif step == "release-whole":
                node.kubelet.release(f"w{number}")
                whole = False
            else:
                restart_daemon(node)
            assert held_both_ways(node) == set(), order
            assert seen(node, expected_lists(node, shared, whole)), (order, step)


# ------------------------------------------------------------------ fixed pools


def test_card_modes_split_the_node_into_fixed_pools(node: Node) -> None:
    start(node, 3, card_modes=f"0=exclusive,{gpu_uuid(1)}=shared")
    assert list(node.kubelet.devices(gpu(node))) == [gpu_uuid(0), gpu_uuid(2)]
    memory_cards = {card_of(d) for d in node.kubelet.devices(node.memory)}
    assert memory_cards == {gpu_uuid(1), gpu_uuid(2)}
    node.kubelet.admit("train", "main", {gpu(node): 2})
    # the both-card is held whole now; only the shared-only card offers units
    assert seen(node, {(node.memory, gpu_uuid(2)): 0, (node.memory, gpu_uuid(1)): UNITS})


def test_card_modes_naming_no_card_stop_the_start(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    node.kubelet.start()
    node.settings = node.settings.__class__(
        **{**node.settings.__dict__, "whole_cards": True, "card_modes": "7=exclusive"}
    )
    with pytest.raises(NodeConfigurationError, match="names no GPU of this node: 7"):
        Daemon(node.settings).start()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("0", "is not <card index or UUID>=<mode>"),
        ("0=whole", "not one of shared, exclusive, both"),
        ("0=shared,0=both", "given a mode twice"),
        ("=shared", "is not <card index or UUID>"),
    ],
)
def test_card_modes_that_cannot_be_read_are_refused(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_card_modes(text)


def test_card_modes_read_in_any_spelling() -> None:
    assert parse_card_modes(" 0 = Exclusive , GPU-x=shared,") == {
        "0": CardMode.EXCLUSIVE,
        "GPU-x": CardMode.SHARED,
    }
    assert parse_card_modes("") == {}
