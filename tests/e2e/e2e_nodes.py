"""The e2e session's nodes and simulated cards (imported by the tests and the conftest; a
module of its own, since `from conftest import` would be ambiguous beside tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kube_cluster import NodeSpec

TESLA_P4 = {"name": "Tesla P4", "memory_mib": 7611}
CARD_4GIB = {"name": "Test 4GiB", "memory_mib": 4096}


def gpu_uuid(node: int, i: int) -> str:
    return f"GPU-{node:08x}-0000-4000-8000-{i:012x}"


def cards(node: int, model: dict[str, Any], count: int) -> list[dict[str, Any]]:
    return [
        {"uuid": gpu_uuid(node, i), **model, "index": i, "numa_node": i % 2} for i in range(count)
    ]


#: The cards' own CDI spec, as nvidia-ctk or the GPU Operator writes it (in /etc/cdi).
CARD_SPEC = "nvidia.com-gpu.json"


def write_card_spec(directory: Path, gpus: list[dict[str, Any]]) -> Path:
    """The cards' own CDI names in ``directory``: each card's edits name it
    (``SIM_CARD=<uuid>``), so a process can tell which card it was given."""
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {"name": g["uuid"], "containerEdits": {"env": [f"SIM_CARD={g['uuid']}"]}}
            for g in gpus
        ],
    }
    path = directory / CARD_SPEC
    path.write_text(json.dumps(spec))
    return path


#: The session's nodes: node-1 with three Tesla P4 (29 units of 256 MiB each), node-2 with
#: two 4 GiB cards (16 units each), so that 20 units fit node-2's total but no card of it.
NODES = [
    NodeSpec("node-1", cards(1, TESLA_P4, 3)),
    NodeSpec("node-2", cards(2, CARD_4GIB, 2)),
]
