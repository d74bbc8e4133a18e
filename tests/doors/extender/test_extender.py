"""The scheduler extender over real HTTP, with requests shaped the way kube-scheduler sends them.

kube-scheduler (nodeCacheCapable: false) POSTs ExtenderArgs with capitalised keys:
``{"Pod": <Pod>, "Nodes": {"items": [<Node>...]}, "NodeNames": null}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from kit.extender import (
    MEMORY,
    P4_MIB,
    PREFIX,
    RunningExtender,
    args,
    card,
    container,
    extender,
    extender_factory,
    kept,
    node,
    pod,
)

from gpushare.extender.fit import CardRoom, ContainerNeed, PodNeed, fit_pod
from gpushare.extender.ledger import AdmissionLedger
from gpushare.kube import nodestate

__all__ = ["extender", "extender_factory"]  # fixtures

# -- the reference cases ---------------------------------------------------------------


def test_p4_node_holding_20_and_4_plus_20_drops_a_10_unit_pod(extender: RunningExtender) -> None:
    full = node("p4-full", [card(0, 20, memory_mib=P4_MIB), card(1, 24, memory_mib=P4_MIB)])
    roomy = node("p4-roomy", [card(0, 20, memory_mib=P4_MIB), card(1, 4, memory_mib=P4_MIB)])
    answer = extender.filter(args(pod("ten", container("main", memory=10)), full, roomy))
    assert answer["FailedNodes"] == {"p4-full": "no single card has 10 free units: GPU0 9, GPU1 5"}
    assert answer["Nodes"]["items"] == [roomy]  # the full Node object, as sent
    assert answer["Error"] == ""


def test_two_4gib_cards_with_2gib_free_each_drop_a_3gib_pod(extender: RunningExtender) -> None:
    half = node("two-4g", [card(0, 8), card(1, 8)])
    answer = extender.filter(args(pod("three-gib", container("main", memory=12)), half))
    assert kept(answer) == []
    assert answer["FailedNodes"] == {"two-4g": "no single card has 12 free units: GPU0 8, GPU1 8"}
    # 2 GiB + 2 GiB still pack onto one card.
    answer = extender.filter(args(pod("two-gib", container("main", memory=8)), half))
    assert kept(answer) == ["two-4g"]


def test_containers_of_one_pod_count_together_on_a_card(extender: RunningExtender) -> None:
    one_card_free = node("left", [card(0, 4), card(1, 16)])  # 12 and 0 free
    split = node("split", [card(0, 10), card(1, 10)])  # 6 and 6 free
    small = node("small", [card(0, 11), card(1, 10)])  # 5 and 6 free
    two = pod("two", container("a", memory=6), container("b", memory=6))
    answer = extender.filter(args(two, one_card_free, split, small))
    assert kept(answer) == ["left", "split"]
    assert answer["FailedNodes"] == {
        "small": "no single card has 6 free units for container b after placing a on GPU1: "
        "GPU0 5, GPU1 0"
    }
    three = pod(
        "three", container("a", memory=6), container("b", memory=6), container("c", memory=1)
    )
    # (A fresh node name: "left" holds the pod "two" in the ledger now.)
    one_card_free["metadata"]["name"] = "left-again"
    answer = extender.filter(args(three, one_card_free))
    assert answer["FailedNodes"] == {
        "left-again": "no single card has 1 free unit for container c after placing a on GPU0, "
        "b on GPU0: GPU0 0, GPU1 0"
    }
    # A sidecar without GPU resources is not a GPU container.
    sidecar = pod("sidecar", container("main", memory=12), {"name": "log", "image": "busybox"})
    one_card_free["metadata"]["name"] = "left-third"
    assert kept(extender.filter(args(sidecar, one_card_free))) == ["left-third"]


def test_memory_and_cores_must_fit_on_the_same_card(extender: RunningExtender) -> None:
    # GPU0 has the memory but not the cores, GPU1 the cores but not the memory.
    crossed = node("crossed", [card(0, 6, cores_used=90), card(1, 14, cores_used=0)])
    both = pod("both", container("main", memory=8, core=50))
    answer = extender.filter(args(both, crossed))
    assert answer["FailedNodes"] == {
        "crossed": "no single card has 8 free units and 50 free core units: "
        "GPU0 10 units/10 cores, GPU1 2 units/100 cores"
    }
    # Core only: no memory units needed, so the card with no free memory still serves.
    full_memory = node("full-memory", [card(0, 16, cores_used=20)])
    assert kept(extender.filter(args(pod("core", container("main", core=80)), full_memory))) == [
        "full-memory"
    ]
    full_memory["metadata"]["name"] = "full-memory-2"  # "full-memory" holds pod "core" now
    answer = extender.filter(args(pod("core90", container("main", core=90)), full_memory))
    assert answer["FailedNodes"] == {
        "full-memory-2": "no single card has 90 free core units: GPU0 80"
    }
    # Memory only: no core units needed, so a card whose cores are all taken still serves.
    busy_cores = node("busy-cores", [card(0, 0, cores_used=100)])
    assert kept(extender.filter(args(pod("mem", container("main", memory=4)), busy_cores))) == [
        "busy-cores"
    ]


def test_unhealthy_cards_are_ignored(extender: RunningExtender) -> None:
    one_bad = node("one-bad", [card(0, 12), card(1, 0, healthy=False)])
    answer = extender.filter(args(pod("eight", container("main", memory=8)), one_bad))
    assert answer["FailedNodes"] == {
        "one-bad": "no single card has 8 free units: GPU0 4, GPU1 unhealthy"
    }
    all_bad = node("all-bad", [card(0, 0, healthy=False), card(1, 0, healthy=False)])
    answer = extender.filter(args(pod("one", container("main", memory=1)), all_bad))
    assert answer["FailedNodes"] == {"all-bad": "no healthy card: GPU0 unhealthy, GPU1 unhealthy"}


def test_nodes_without_a_readable_annotation_are_dropped_with_a_reason(
    extender: RunningExtender,
) -> None:
    bare = node("bare", None)
    garbled = node("garbled", [card(0)])
    garbled["metadata"]["annotations"][nodestate.annotation_key(PREFIX)] = '{"version": 1'
    answer = extender.filter(args(pod("p", container("main", memory=1)), bare, garbled))
    assert kept(answer) == []
    assert answer["FailedNodes"]["bare"] == (
        "the node has gpushare resources but neither a state object nor a gpushare.io/gpus "
        "annotation, so its cards are unknown (is the gpushare daemon running there with "
        "NODE_NAME set?)"
    )
    assert answer["FailedNodes"]["garbled"].startswith(
        "the gpushare.io/gpus annotation cannot be read: the gpus annotation is not JSON"
    )


def test_a_pod_without_gpu_containers_keeps_every_node(extender: RunningExtender) -> None:
    plain = pod("plain", {"name": "main", "image": "nginx"})
    nodes = [node("a", [card(0, 16)]), node("b", None)]
    answer = extender.filter(args(plain, *nodes))
    assert kept(answer) == ["a", "b"] and answer["FailedNodes"] == {}


def test_keys_are_read_case_insensitively_as_go_does(extender: RunningExtender) -> None:
    body = {
        "pod": pod("p", container("main", memory=4)),
        "nodes": {"Items": [node("a", [card(0)])]},
    }
    assert kept(extender.filter(body)) == ["a"]


# -- the ledger ------------------------------------------------------------------------


def test_ledger_entries_expire_after_the_timeout_without_pod_lists_or_a_watch() -> None:
    now = [100.0]
    ledger = AdmissionLedger(timeout_seconds=30, clock=lambda: now[0])
    ledger.record("uid-a", "n1", 3, {"GPU-0": (8, 0)})
    assert ledger.pending_use("n1", 3) == {"GPU-0": (8, 0)}
    assert ledger.pending_use("n1", 3, exclude_pod="uid-a") == {}
    now[0] += 31
    assert ledger.pending_use("n1", 3) == {} and len(ledger) == 0


# -- prioritize -------------------------------------------------------------------------


def _ranking(server: RunningExtender) -> list[dict[str, Any]]:
    nodes = [
        node("empty", [card(0, 0), card(1, 0)]),
        node("half", [card(0, 8), card(1, 8)]),
        node("nearly-full", [card(0, 12), card(1, 10)]),
        node("cannot", [card(0, 16), card(1, 14)]),
    ]
    status, answer = server.post("prioritize", args(pod("p", container("main", memory=4)), *nodes))
    assert status == 200
    assert isinstance(answer, list)
    return answer


def test_prioritize_binpack_prefers_the_node_whose_card_is_fullest(
    extender_factory: Callable[..., RunningExtender],
) -> None:
    answer = _ranking(extender_factory(placement="binpack"))
    # A 4-unit pod on 16-unit cards: the card it would get ends 4/16, 12/16 and 16/16 full.
    assert answer == [
        {"Host": "empty", "Score": 3},
        {"Host": "half", "Score": 8},
        {"Host": "nearly-full", "Score": 10},
        {"Host": "cannot", "Score": 0},
    ]


def test_prioritize_spread_prefers_the_node_whose_card_is_emptiest(
    extender_factory: Callable[..., RunningExtender],
) -> None:
    answer = _ranking(extender_factory(placement="spread"))
    # Spread puts it on the emptiest card: it ends 4/16, 12/16 and 14/16 full.
    assert answer == [
        {"Host": "empty", "Score": 8},
        {"Host": "half", "Score": 3},
        {"Host": "nearly-full", "Score": 1},
        {"Host": "cannot", "Score": 0},
    ]


# -- bad requests -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "the body is not JSON"),
        (b"", "the body is empty"),
        (b"[]", "the body must be a JSON object"),
        (b'{"Nodes": {"items": []}}', "Pod is missing"),
        (b'{"Pod": {}}', "Nodes is missing"),
        (b'{"Pod": {}, "NodeNames": ["a"]}', "nodeCacheCapable: false"),
        (b'{"Pod": {}, "Nodes": {"items": {}}}', "Nodes.items must be a list"),
        (b'{"Pod": {}, "Nodes": {"items": [{"metadata": {}}]}}', "Nodes.items[0] is not a Node"),
        (b'{"Pod": {"spec": {"containers": 3}}, "Nodes": {"items": []}}', "must be a list"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_bad_requests_get_400_with_a_message(
    extender: RunningExtender, raw: bytes, message: str
) -> None:
    for verb in ("filter", "prioritize"):
        status, answer = extender.post(verb, None, raw=raw)
        assert status == 400
        assert message in answer["Error"]


def test_a_bad_quantity_is_a_400_naming_the_container(extender: RunningExtender) -> None:
    bad = pod("bad", {"name": "main", "resources": {"limits": {MEMORY: "1Gi"}}})
    status, answer = extender.post("filter", args(bad, node("a", [card(0)])))
    assert status == 400
    assert answer["Error"] == (
        "pod default/bad: container 'main': gpushare.io/vcuda-memory must be a whole number "
        "of units, got '1Gi'"
    )
    # Still serving.
    assert kept(extender.filter(args(pod("ok", container("main", memory=1)), node("a", [card(0)]))))


# -- the pure fit, for what HTTP cannot show cheaply --------------------------------------


def test_fit_places_containers_as_the_daemon_would() -> None:
    rooms = [CardRoom("A", 0, 16, 10, 100), CardRoom("B", 1, 16, 4, 100)]
    need = PodNeed((ContainerNeed("a", 4, 0), ContainerNeed("b", 6, 0)))
    binpack = fit_pod(rooms, need, "binpack")
    assert binpack.placement is not None
    assert binpack.placement.use_by_card() == {"B": (4, 0), "A": (6, 0)}
    spread = fit_pod(rooms, need, "spread")
    assert spread.placement is not None
    assert spread.placement.use_by_card() == {"A": (10, 0)}


# -- the console script -------------------------------------------------------------------


def test_main_serves_on_the_port_it_logs(tmp_path: Any) -> None:
    command = [
        sys.executable, "-m", "gpushare.extender.httpserver",
        "--address", "127.0.0.1", "--port", "0", "--url-prefix", "/x",
        "--log-format", "json", "--placement", "spread",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 20
        port = 0
        while not port and time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            record = json.loads(line)
            if record.get("event") == "listening":
                port = record["port"]
                assert record["filter"] == "/x/filter" and record["placement"] == "spread"
        assert port, "the extender never logged that it was listening"
        body = json.dumps(args(pod("p", container("main", memory=2)), node("a", [card(0)])))
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/x/filter", data=body.encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert kept(json.loads(response.read())) == ["a"]
    finally:
        process.terminate()
        process.wait(10)
