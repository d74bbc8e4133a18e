"""Topology-aware choice of whole cards: NVLink, then NUMA, then PCIe switch."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import yaml
from conftest import H200, Node, cards, gpu_uuid
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.sizes import at_two_sizes

from gpushare.base.startup import NodeConfigurationError
from gpushare.daemon import Daemon
from gpushare.gpu.gpus import GpuError
from gpushare.gpu.simulated import SimulatedBackend
from gpushare.gpu.topology import EXHAUSTIVE_LIMIT, Topology, from_description, pair, prefer

# An 8-card node shaped like the common HGX boards of two halves: NVLink pairs
# (0,1) (2,3) (4,5) (6,7), cards 0-3 on NUMA node 0 and 4-7 on 1, a PCIe switch per pair.
EIGHT = [{**card, "numa_node": 0 if i < 4 else 1} for i, card in enumerate(cards(H200, 8))]
TOPOLOGY = {
    "nvlink": [[0, 1], [2, 3], {"cards": [4, 5], "links": 2}, [6, 7]],
    "pcie_switches": [[0, 1], [2, 3], [4, 5], [6, 7]],
}


def gpu(node: Node) -> str:
    return f"{node.settings.resource_prefix}/gpu"


def start_eight(node: Node, topology: dict[str, Any] | None = TOPOLOGY) -> None:
    node.write_gpus(EIGHT)
    if topology is not None:
        data = yaml.safe_load(node.gpus_file.read_text())
        node.gpus_file.write_text(yaml.safe_dump({**data, "topology": topology}))
    node.kubelet.start()
    node.settings = node.settings.__class__(**{**node.settings.__dict__, "whole_cards": True})
    node.daemon = Daemon(node.settings)
    node.daemon.start()
    assert node.kubelet.wait_for(lambda k: len(k.devices(gpu(node))) == 8)


def indexes(admitted: Any, resource: str) -> list[int]:
    return sorted(int(d.split("-")[1], 16) for d in admitted.devices[resource])


# ------------------------------------------------------------------ over real sockets


def test_two_cards_are_an_nvlink_pair_and_four_are_two_pairs_of_one_numa_node(node: Node) -> None:
    start_eight(node)
    assert indexes(node.kubelet.admit("a", "main", {gpu(node): 2}), gpu(node)) == [4, 5]  # 2 links
    assert indexes(node.kubelet.admit("b", "main", {gpu(node): 4}), gpu(node)) == [0, 1, 2, 3]
    assert indexes(node.kubelet.admit("c", "main", {gpu(node): 2}), gpu(node)) == [6, 7]


def test_single_cards_break_no_pair_that_is_still_whole(node: Node) -> None:
    start_eight(node)
    first = indexes(node.kubelet.admit("a", "main", {gpu(node): 1}), gpu(node))
    second = indexes(node.kubelet.admit("b", "main", {gpu(node): 1}), gpu(node))
    # the second single takes the partner of the first: three pairs stay whole
    assert {first[0] // 2} == {second[0] // 2}
    for name in ("c", "d", "e"):
        assert indexes(node.kubelet.admit(name, "main", {gpu(node): 2}), gpu(node)) in (
            [0, 1],
            [2, 3],
            [4, 5],
            [6, 7],
        )


def test_without_nvlink_numa_decides(node: Node) -> None:
    start_eight(node, topology=None)
    chosen = indexes(node.kubelet.admit("a", "main", {gpu(node): 4}), gpu(node))
    assert chosen == [0, 1, 2, 3]  # one NUMA node
    assert indexes(node.kubelet.admit("b", "main", {gpu(node): 2}), gpu(node)) == [4, 5]


def test_a_topology_naming_no_card_stops_the_start(node: Node) -> None:
    with pytest.raises(NodeConfigurationError, match="names no card of this node: 9"):
        start_eight(node, topology={"nvlink": [[0, 9]]})


# ------------------------------------------------------------------ the pure rule

UUIDS = [gpu_uuid(i) for i in range(8)]
HGX = Topology(
    nvlinks={pair(UUIDS[i], UUIDS[i + 1]): 1 for i in range(0, 8, 2)},
    numa={u: 0 if i < 4 else 1 for i, u in enumerate(UUIDS)},
    switch={u: f"s{i // 2}" for i, u in enumerate(UUIDS)},
)


def test_must_include_is_kept_and_its_partner_joins_it() -> None:
    assert prefer(UUIDS, [UUIDS[3]], 2, HGX) == [UUIDS[2], UUIDS[3]]


def test_a_full_mesh_prefers_the_numa_node_then_positions() -> None:
    mesh = Topology(
        nvlinks={pair(a, b): 1 for a, b in itertools.combinations(UUIDS, 2)},
        numa=HGX.numa,
    )
    assert prefer(UUIDS, [], 4, mesh) == UUIDS[:4]
    assert prefer(UUIDS[2:], [], 2, mesh) == UUIDS[2:4]


@st.composite
def topologies(draw: st.DrawFn) -> tuple[list[str], Topology]:
    count = draw(st.integers(1, 16))
    uuids = UUIDS[:count] + [gpu_uuid(i) for i in range(8, count)]
    links = draw(
        st.dictionaries(
            st.tuples(st.sampled_from(uuids), st.sampled_from(uuids)).filter(
                lambda p: p[0] != p[1]
            ),
            st.integers(1, 4),
            max_size=12,
        )
    )
    numa = {u: draw(st.none() | st.integers(0, 1)) for u in uuids}
    return uuids, Topology(nvlinks={pair(a, b): n for (a, b), n in links.items()}, numa=numa)


@at_two_sizes(given(topologies(), st.data()), quick=40, full=150, deadline=None)
def test_every_answer_is_a_valid_set(node_topology: tuple[list[str], Topology], data: Any) -> None:
    uuids, topology = node_topology
    available = data.draw(st.lists(st.sampled_from(uuids), min_size=1, unique=True))
    must = data.draw(st.lists(st.sampled_from(available), unique=True))
    size = data.draw(st.integers(max(1, len(must)), len(available)))
    chosen = prefer(available, must, size, topology)
    assert len(chosen) == size == len(set(chosen))
    assert set(must) <= set(chosen) <= set(available)
    assert chosen == sorted(chosen, key=available.index)  # stable order
    assert prefer(available, must, size, topology) == chosen


@settings(max_examples=60, deadline=None)
@given(topologies())
def test_a_whole_nvlink_pair_is_given_to_a_two_card_request(
    node_topology: tuple[list[str], Topology],
) -> None:
    uuids, topology = node_topology
    if len(uuids) < 2:
        return
    chosen = prefer(uuids, [], 2, topology)
    best = max((topology.links(a, b) for a, b in itertools.combinations(uuids, 2)), default=0)
    assert topology.links(*chosen) == best


def test_large_nodes_are_chosen_greedily_and_still_keep_pairs() -> None:
    uuids = [gpu_uuid(i) for i in range(32)]
    topology = Topology(nvlinks={pair(uuids[i], uuids[i + 1]): 1 for i in range(0, 32, 2)})
    chosen = prefer(uuids, [], 8, topology)
    assert math.comb(len(uuids), 8) > EXHAUSTIVE_LIMIT  # so the greedy path ran
    assert sum(topology.links(a, b) for a, b in itertools.combinations(chosen, 2)) == 4


# ------------------------------------------------------------------ the node file section


def test_the_topology_section_is_read_by_index_or_uuid() -> None:
    by_key = {str(i): u for i, u in enumerate(UUIDS)} | {u: u for u in UUIDS}
    topology = from_description(
        {"nvlink": [[0, UUIDS[1], 2]], "pcie_switches": [[3, 4]]}, by_key, {UUIDS[0]: 1}
    )
    assert topology.links(UUIDS[0], UUIDS[1]) == 1 and topology.links(UUIDS[1], UUIDS[2]) == 1
    assert topology.same_switch(UUIDS[3], UUIDS[4]) and not topology.same_switch(UUIDS[0], UUIDS[1])
    assert topology.partners(UUIDS[0]) == [UUIDS[1], UUIDS[2]]


@pytest.mark.parametrize(
    ("section", "error"),
    [
        ([1], "must be a mapping"),
        ({"nvlinks": []}, "unknown keys: nvlinks"),
        ({"nvlink": [[0]]}, "at least two cards"),
        ({"nvlink": [{"cards": [0, 1], "links": 0}]}, "positive integer"),
        ({"pcie_switches": [[0, "GPU-x"]]}, "names no card"),
    ],
)
def test_mistakes_in_the_section_are_named(section: object, error: str, tmp_path: Any) -> None:
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump({"gpus": cards(H200, 2), "topology": section}))
    with pytest.raises(GpuError, match=error):
        SimulatedBackend(path).topology()
