"""``kubectl gpushare inspect`` of a node with DRA cards beside a shared card: the full
table (with and without ``-d``), the JSON, the namespace filter, escaping, truncation."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from test_inspect import P4, PREFIX, _card, _pod

from gpushare.kube import nodestate
from gpushare.ops.inspect import build_view, render_json, render_table

A100 = ("NVIDIA A100", 40960)


def _dra(index: int, model: tuple[str, int], *claims: nodestate.DraClaimState) -> Any:
    name, mib = model
    card = nodestate.WholeCardState(f"GPU-dra-{index}", index, name, mib, True)
    return nodestate.with_dra_claims(card, claims)


def _node(*whole: nodestate.WholeCardState) -> dict[str, Any]:
    state = nodestate.NodeGpuState(
        4, "2026-11-22T13:00:00Z", 256, (_card(0, P4, 8, 20),), tuple(whole)
    )
    return {
        "kind": "Node",
        "metadata": {
            "name": "gpu-a",
            "annotations": {nodestate.annotation_key(PREFIX): nodestate.encode(state)},
        },
    }


CLAIMS = (
    nodestate.DraClaimState("ml", "small", "gpu", "gpu-1", 1024, 30),
    nodestate.DraClaimState("batch", "old", "gpu", "gpu-1", None, None),
    nodestate.DraClaimState("ml", "mem", "", "gpu-1", 2048, 0),
)
MIG = nodestate.DraClaimState("ml", "m", "gpu", "gpu-2-mig-1-0", 19968, 0)

TABLE = """\
NODE gpu-a  (3 cards, 256 MiB units, generation 4, updated 2026-11-22T13:00:00Z)
  GPU  NAME         MEMORY MiB             UNITS  CORES   HEALTH
  0    Tesla P4     2048/7424    (27.6 %)  8/29   20/100  healthy
  1    Tesla P4     3072/7424    (41.4 %)  DRA    30/100  healthy
  2    NVIDIA A100  19968/40960  (48.8 %)  DRA    0/100   UNHEALTHY

CLUSTER  1 node, 3 cards (2 healthy)
  memory  25088/55808 MiB (45.0 %)
  cores   50/300 (16.7 %)
"""

DETAILS = """\
NODE gpu-a  (3 cards, 256 MiB units, generation 4, updated 2026-11-22T13:00:00Z)
  GPU  NAME                                 MEMORY MiB             UNITS  CORES   HEALTH
  0    Tesla P4                             2048/7424    (27.6 %)  8/29   20/100  healthy
         ml/p/main                          2048                   8      20
  1    Tesla P4                             3072/7424    (41.4 %)  DRA    30/100  healthy
         claim ml/small (gpu)               1024                          30
         claim batch/old (gpu)              ?                             ?
         claim ml/mem                       2048                          0
  2    NVIDIA A100                          19968/40960  (48.8 %)  DRA    0/100   UNHEALTHY
         claim ml/m (gpu) on gpu-2-mig-1-0  19968                         0

CLUSTER  1 node, 3 cards (2 healthy)
  memory  25088/55808 MiB (45.0 %)
  cores   50/300 (16.7 %)
"""


def _cluster() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    sick = replace(_dra(2, A100, MIG), healthy=False)
    nodes = [_node(_dra(1, P4, *CLAIMS), sick)]
    pods = [_pod("p", "gpu-a", {"main": (8, 20, "GPU-P4-0")})]
    return nodes, pods


def test_dra_cards_in_the_table_with_their_claims() -> None:
    view = build_view(*_cluster(), PREFIX)
    assert render_table(view) == TABLE
    assert render_table(view, details=True) == DETAILS


def test_dra_cards_in_json_and_the_totals() -> None:
    data = json.loads(render_json(build_view(*_cluster(), PREFIX)))
    (node,) = data["nodes"]
    card = node["wholeGpus"][0]
    assert {k: v for k, v in card.items() if k != "claims"} == {
        "index": 1,
        "uuid": "GPU-dra-1",
        "name": "Tesla P4",
        "healthy": True,
        "memoryMib": 7611,
        "heldBy": None,
        "mig": [],
        "mode": "dra",
        "memoryTotalMib": 7424,
        "memoryUsedMib": 3072,
        "coreUnits": 100,
        "coreUnitsUsed": 30,
        "claimCount": 3,
        "claimsTruncated": False,
    }
    assert card["claims"][0] == {
        "namespace": "ml",
        "claim": "small",
        "request": "gpu",
        "device": "gpu-1",
        "memoryMib": 1024,
        "cores": 30,
    }
    assert card["claims"][1]["memoryMib"] is None  # recorded by a daemon that did not say
    totals = data["totals"]
    assert (totals["memoryMib"], totals["memoryUsedMib"]) == (7424 * 2 + 40960, 2048 + 3072 + 19968)
    assert (totals["coreUnits"], totals["coreUnitsUsed"]) == (300, 50)


def test_the_namespace_filter_lists_that_namespaces_claims_and_keeps_the_figures() -> None:
    nodes, pods = _cluster()
    view = build_view(nodes, pods, PREFIX, namespace="batch")
    card = view.nodes[0].whole[0]
    assert [c.claim for c in card.claims] == ["old"]
    assert (card.claim_count, card.memory_used_mib) == (3, 3072)
    assert "claim ml/" not in render_table(view, details=True)


def test_a_truncated_list_says_how_many_claims_there_are() -> None:
    claims = tuple(
        nodestate.DraClaimState("ml", f"c{i:02}", "gpu", "gpu-1", 256, 0) for i in range(70)
    )
    card = nodestate.listed_claims(_dra(1, A100, *claims))
    table = render_table(build_view([_node(card)], [], PREFIX), details=True)
    assert "(70 claims, 64 listed)" in table and "17920/40960" in table
    assert "claim ml/c63" in table and "claim ml/c64" not in table


def test_names_in_claims_are_shown_escaped() -> None:
    evil = "\x1b[2Kx\r"
    claim = nodestate.DraClaimState("ml", "c", evil, f"gpu-9{evil}", 256, 0)
    view = build_view([_node(_dra(1, P4, claim))], [], PREFIX)
    table = render_table(view, details=True)
    assert "\x1b" not in table and "\r" not in table and "\\x1b[2Kx" in table
    assert "\x1b" not in render_json(view)
