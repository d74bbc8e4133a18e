"""gpushare.bench.processes: the benchmark's containers ask 1 to 6.25 GiB (four sizes) and 5 to
20 % of a card, core first in three admissions of four (as the kubelet mostly does), on
a node of H200s whose IDs stay within the kubelet's 63 characters."""

from __future__ import annotations

from collections import Counter

from gpushare.bench.processes import (
    CORE,
    MEMORY,
    container_needs,
    container_order,
    gpu_uuid,
    node_gpus,
)
from gpushare.share.devices import MAX_DEVICE_ID_LENGTH, Inventory


def test_container_sizes_span_their_range() -> None:
    needs = [container_needs(i) for i in range(400)]
    assert {m for m, _c in needs} == {4, 11, 18, 25}  # 1 to 6.25 GiB of 256 MiB units
    assert {c for _m, c in needs} == set(range(5, 21))


def test_core_first_in_three_admissions_of_four() -> None:
    orders = Counter(tuple(container_order(i)) for i in range(400))
    assert orders == {(CORE, MEMORY): 300, (MEMORY, CORE): 100}


def test_the_node_is_indexed_and_its_ids_fit_the_kubelet() -> None:
    gpus = node_gpus(16, 192 * 1024)
    assert [g.index for g in gpus] == list(range(16)) and len({g.uuid for g in gpus}) == 16
    assert gpus[3].uuid == gpu_uuid(3) and gpus[3].numa_node == 1
    inventory = Inventory(gpus, 256)  # raises for an ID over the limit
    assert len(inventory) == 16 and len(gpu_uuid(15) + "::767") <= MAX_DEVICE_ID_LENGTH
