"""The e2e suite's fixtures: one real cluster for the whole session (see e2e/README.md).

Every test here is marked ``e2e`` and left out of ``make test``'s default run; ``make e2e``
builds the Kubernetes programs and runs ``pytest -m e2e tests/e2e``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_cluster import REPO, Cluster, NodeSpec

HERE = Path(__file__).parent

TESLA_P4 = {"name": "Tesla P4", "memory_mib": 7611}
CARD_4GIB = {"name": "Test 4GiB", "memory_mib": 4096}


def gpu_uuid(node: int, i: int) -> str:
    return f"GPU-{node:08x}-0000-4000-8000-{i:012x}"


def cards(node: int, model: dict[str, Any], count: int) -> list[dict[str, Any]]:
    return [
        {"uuid": gpu_uuid(node, i), **model, "index": i, "numa_node": i % 2} for i in range(count)
    ]


#: The session's nodes: node-1 with three Tesla P4 (29 units of 256 MiB each), node-2 with
#: two 4 GiB cards (16 units each), so that 20 units fit node-2's total but no card of it.
NODES = [
    NodeSpec("node-1", cards(1, TESLA_P4, 3)),
    NodeSpec("node-2", cards(2, CARD_4GIB, 2)),
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The running cluster. Tests leave it as they found it: delete their pods, stop what they
    started, restore the scheduler and daemons they changed."""
    if os.geteuid() != 0:
        pytest.fail("the e2e cluster needs root (mount namespaces for its kubelets)")
    c = Cluster(NODES)
    try:
        c.start()
        yield c
    finally:
        c.stop_keeping_logs(REPO / "e2e" / "logs")
