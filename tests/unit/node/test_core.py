"""gpushare.node.core: the node's core built from the settings and what discovery found
(nothing started): one inventory and one usage ledger for every door, whole cards
beside the shared units with the two uses excluding each other on a card, the parts in
their start order, and the usage summary logged at start."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest
from conftest import TESLA_P4, Node, cards

from gpushare.node.core import NodeCore, build_core, core_parts, late_parts, usage_summary
from gpushare.node.discovery import Discovery
from gpushare.share.devices import Resource


@pytest.fixture
def core(node: Node) -> Iterator[NodeCore]:
    node.write_gpus(cards(TESLA_P4, 2))
    settings = replace(node.settings, whole_cards=True)
    discovery = Discovery(settings, threading.Event())
    try:
        yield build_core(settings, discovery.run())
    finally:
        discovery.close()


def test_one_inventory_every_card_and_the_parts_in_order(core: NodeCore) -> None:
    assert not core.no_gpus
    assert [g.index for g in core.physical_cards()] == [0, 1]
    assert len(core.inventory) == 2
    assert {c.units(Resource.MEMORY) for c in core.inventory.cards.values()} == {7611 // 256}
    names = [p.name for p in core_parts(core)]
    assert names == ["pod-resources", "reaper", "health-monitor"]
    assert [p.name for p in late_parts(core)] == ["usage-refresher"]  # no API link here
    (whole,) = core.whole
    assert whole[0] == "gpushare.io/gpu" and len(whole[1]) == 2


def test_whole_use_and_shared_use_exclude_each_other_per_card(core: NodeCore) -> None:
    assert core.exclusion is not None
    core.exclusion.refresh()
    name, devices, board = core.whole[0]
    first, second = sorted(devices.devices.values(), key=lambda d: d.index)
    core.whole_allocated(name, [first])
    assert not core.availability.is_healthy(first.id)  # its shared units withdrawn
    assert core.availability.is_healthy(second.id)
    core.usage.record_allocation(Resource.MEMORY, second.id, [0, 1])
    core.shared_allocated(Resource.MEMORY, second.id, [f"{second.id}::0"])
    assert not board.is_healthy(second.id)  # its whole device withdrawn
    assert usage_summary(core.usage) == {
        "vcuda-memory_used": {second.id: 2},
        "vcuda-core_used": {},
    }
