"""gpushare.share.unitindex: the precomputed ID index groups a request's units by card
exactly as the inventory's own (slow, checking) resolve does, and refuses the same IDs:
unknown, out of range, malformed, or listed twice."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.gpu.gpus import Gpu
from gpushare.share.devices import InvalidDeviceIds, Inventory, Resource, format_device_id
from gpushare.share.unitindex import UnitIndex

GPUS = [
    Gpu(uuid=f"GPU-{i}", name="Tesla T4", memory_mib=mib, index=i, minor=i)
    for i, mib in enumerate((1024, 2048, 768))
]
INVENTORY = Inventory(GPUS, 256)
INDEX = UnitIndex(INVENTORY)

#: Every ID the node has, and some that it has not.
KNOWN = [
    format_device_id(card.uuid, n)
    for card in INVENTORY.cards.values()
    for n in range(max(card.units(Resource.MEMORY), card.units(Resource.CORE)))
]
STRANGE = ["GPU-9::0", "GPU-0::100", "GPU-0::01", "GPU-0", "", "::3", "GPU-0::-1"]


@given(st.sampled_from(list(Resource)), st.lists(st.sampled_from(KNOWN + STRANGE), max_size=8))
def test_the_index_agrees_with_the_inventory(resource: Resource, ids: list[str]) -> None:
    try:
        expected = INVENTORY.resolve(resource, ids)
    except InvalidDeviceIds:
        with pytest.raises(InvalidDeviceIds):
            INDEX.group(resource, ids)
        return
    assert INDEX.group(resource, ids) == expected


def test_units_keep_request_order_per_card() -> None:
    ids = ["GPU-1::5", "GPU-0::1", "GPU-1::0", "GPU-0::3"]
    assert INDEX.group(Resource.MEMORY, ids) == {"GPU-1": [5, 0], "GPU-0": [1, 3]}


def test_a_memory_unit_past_the_card_is_not_a_unit_but_a_core_unit_may_be() -> None:
    assert INVENTORY.cards["GPU-2"].units(Resource.MEMORY) == 3
    with pytest.raises(InvalidDeviceIds):
        INDEX.group(Resource.MEMORY, ["GPU-2::3"])
    assert INDEX.group(Resource.CORE, ["GPU-2::3"]) == {"GPU-2": [3]}


def test_a_unit_listed_twice_is_named() -> None:
    with pytest.raises(InvalidDeviceIds, match="'GPU-0::1' is listed twice"):
        INDEX.group(Resource.CORE, ["GPU-0::1", "GPU-1::1", "GPU-0::1"])
