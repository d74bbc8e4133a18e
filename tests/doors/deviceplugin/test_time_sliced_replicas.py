"""Time-sliced replicas (card mode ``timeslice``): N replicas of ``<prefix>/gpu.shared`` per
card, served over a device-plugin socket to the stand-in kubelet. Each container asks one
and gets the whole card, no limits; a card in that mode is offered no other way; shown in
the node annotation, inspect and the metrics."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import H200, TESLA_P4, Node, cards, gpu_uuid
from hypothesis import given
from hypothesis import strategies as st

from gpushare.config import matcher
from gpushare.daemon import Daemon
from gpushare.gpu.gpus import Gpu
from gpushare.kube import nodestate
from gpushare.share.cardmodes import REPLICAS_PATTERN, parse_replicas
from gpushare.share.whole import ExclusiveDevice, spread_replicas, time_sliced
from gpushare.sim.kubeletdouble import AdmissionError


def shared_gpu(node: Node) -> str:
    return f"{node.settings.resource_prefix}/gpu.shared"


def start_sliced(node: Node, gpus: list[dict[str, Any]], **overrides: Any) -> None:
    """Start the daemon as ``node.start`` does, waiting for gpu.shared (a node whose
    cards are all time-sliced offers no units)."""
    node.write_gpus(gpus)
    node.settings = replace(node.settings, **overrides)
    node.kubelet.start()
    node.daemon = Daemon(node.settings, specs=node.specs)
    node.daemon.start()
    assert node.kubelet.wait_for(lambda k: bool(k.devices(shared_gpu(node))))


def test_n_replicas_per_card_and_no_other_offer(node: Node) -> None:
    start_sliced(
        node, cards(H200, 3), card_modes="0=timeslice,1=timeslice", time_slice_replicas="3,1=5"
    )
    devices = node.kubelet.devices(shared_gpu(node))
    assert sorted(devices) == sorted(
        [f"{gpu_uuid(0)}::{n}" for n in range(3)] + [f"{gpu_uuid(1)}::{n}" for n in range(5)]
    )
    assert all(d.health == "Healthy" for d in devices.values())
    # the sliced cards offer no units; card 2 (not sliced) offers its units as before
    memory_cards = {i.rpartition("-")[0] for i in node.kubelet.devices(node.memory)}
    assert gpu_uuid(0) not in str(memory_cards) and gpu_uuid(1) not in str(memory_cards)
    assert any(gpu_uuid(2) in i for i in node.kubelet.devices(node.memory))
    (name,) = node.kubelet.registered_names(shared_gpu(node))
    assert name.startswith("gpushare-gpu.shared.") and name.endswith(".sock")


def test_a_container_gets_the_card_with_no_limits_and_tenants_spread(node: Node) -> None:
    start_sliced(
        node, cards(TESLA_P4, 2), card_modes="0=timeslice,1=timeslice", time_slice_replicas="2"
    )
    seen = []
    for name in ("a", "b", "c", "d"):
        got = node.kubelet.admit(name, "main", {shared_gpu(node): 1})
        (replica,) = got.devices[shared_gpu(node)]
        card = replica.rpartition("::")[0]
        assert got.envs["NVIDIA_VISIBLE_DEVICES"] == card
        assert not any(k.startswith(("CUDA_", "LD_PRELOAD")) for k in got.envs)
        assert got.mounts == {}
        seen.append(card)
    assert sorted(seen[:2]) == [gpu_uuid(0), gpu_uuid(1)]  # spread before stacking
    assert sorted(seen) == sorted([gpu_uuid(0), gpu_uuid(1)] * 2)
    with pytest.raises(AdmissionError, match="Insufficient"):
        node.kubelet.admit("e", "main", {shared_gpu(node): 1})
    node.kubelet.release("a")
    assert node.kubelet.admit("f", "main", {shared_gpu(node): 1}).card() == seen[0]


def test_two_replicas_for_one_container_are_refused(node: Node) -> None:
    start_sliced(node, cards(H200, 1), card_modes="0=timeslice")
    with pytest.raises(AdmissionError, match=r"asks 2 .*gpu\.shared; it gets 1"):
        node.kubelet.admit("greedy", "main", {shared_gpu(node): 2})
    assert node.kubelet.admit("fair", "main", {shared_gpu(node): 1}).card() == gpu_uuid(0)


def test_shown_in_annotation_inspect_and_metrics(node: Node) -> None:
    start_sliced(node, cards(H200, 2), card_modes="1=timeslice", time_slice_replicas="4")
    node.kubelet.admit("a", "main", {shared_gpu(node): 1})
    daemon = node.daemon
    assert daemon is not None and daemon.core is not None
    core = daemon.core
    assert core.backends[gpu_uuid(1)].memory.value == "none"
    assert core.backends[gpu_uuid(1)].compute.value == "none"
    core.refresher.refresh_once()
    extras = core.card_facts.extras()
    (card,) = [w for w in extras.whole if w.uuid == gpu_uuid(1)]
    assert (card.mode, card.replicas, card.replicas_held) == ("timeslice", 4, 1)
    assert card.held_by == "default/a/main"
    encoded = nodestate._whole_json(card)
    assert encoded["mode"] == "timeslice" and encoded["replicas"] == 4
    again = nodestate._decode_whole(json.loads(json.dumps(encoded)), "w")
    assert again == card
    # a card in another mode carries none of it
    plain = nodestate._whole_json(nodestate.WholeCardState(gpu_uuid(0), 0, "x", 1, True))
    assert "replicas" not in plain and "mode" not in plain
    from gpushare.ops.inspect import _whole_rows

    (row,) = _whole_rows(card, wide=False)
    assert "time-sliced x4" in row[2] and "1/4 replicas" in row[6]


def test_replicas_of_many_holders_are_named_briefly() -> None:
    card = nodestate.WholeCardState("GPU-1", 0, "x", 1, True)
    shown = nodestate.with_replicas(card, 8, [f"ns/p{i}/c" for i in range(7)])
    assert shown.replicas_held == 7 and shown.held_by.endswith("and 3 more")


@given(
    st.lists(st.tuples(st.sampled_from(["0", "1", "GPU-a", ""]), st.integers(0, 70)), max_size=4)
)
def test_the_replicas_pattern_and_parser_agree(entries: list[tuple[str, int]]) -> None:
    text = ",".join(f"{k}={n}" if k else str(n) for k, n in entries)
    try:
        parse_replicas(text)
        parsed = True
    except ValueError:
        parsed = False
    matched = bool(matcher(REPLICAS_PATTERN).search(text))
    keys = [k for k, _ in entries]
    twice = len(keys) != len(set(keys))
    assert parsed == (matched and not twice), text


@given(st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_spread_prefers_the_card_with_most_free_replicas(parents: list[int]) -> None:
    gpus = [Gpu(f"GPU-{i}", "x", 1024, i, i) for i in range(4)]
    resource = time_sliced(gpus, {g.uuid: 12 for g in gpus})
    free: list[ExclusiveDevice] = []
    for i, p in enumerate(parents):
        free.append(resource.devices[f"GPU-{p}::{i}"])
    (first,) = spread_replicas(free, [], 1)
    counts = {p: parents.count(p) for p in parents}
    assert counts[int(first.split("::")[0][4:])] == max(counts.values())


def test_a_pin_on_a_sliced_card_refuses_the_start(node: Node, short_tmp: Path) -> None:
    from gpushare.base.startup import StartupError

    with pytest.raises(StartupError, match="time-sliced"):
        node.start(cards(H200, 1), card_modes="0=timeslice", compute_enforcement="0=interposer")


def test_replicas_on_the_metrics_endpoint(node: Node) -> None:
    from kit.procs import free_port, poll, scrape
    from test_metrics import per_card

    port = free_port()
    start_sliced(
        node, cards(TESLA_P4, 2), card_modes="1=timeslice", time_slice_replicas="3",
        metrics_port=port, metrics_address="127.0.0.1",
    )  # fmt: skip
    node.kubelet.admit("a", "main", {shared_gpu(node): 1})

    def figures() -> tuple[dict[str, float], dict[str, float]]:
        seen = per_card(scrape(port)[1])
        return (
            seen.get("gpushare_timeslice_replicas", {}),
            seen.get("gpushare_timeslice_replicas_held", {}),
        )

    assert poll(lambda: figures() == ({gpu_uuid(1): 3}, {gpu_uuid(1): 1}), 30.0), figures()
