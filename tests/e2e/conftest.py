"""The e2e suite's fixtures: one real cluster for the whole session (see e2e/README.md).

Every test here is marked ``e2e`` and left out of ``make test``'s default run; ``make e2e``
builds the Kubernetes programs and runs ``pytest -m e2e tests/e2e``."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_nodes import NODES
from kube_cluster import REPO, Cluster, running_cluster

HERE = Path(__file__).parent
LOGS = REPO / "e2e" / "logs"


def pytest_sessionstart(session: pytest.Session) -> None:
    shutil.rmtree(LOGS, ignore_errors=True)  # this run's logs only


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
    with running_cluster(NODES, logs=LOGS / "cluster") as c:
        yield c
