"""The e2e suite's fixtures: one real cluster for the whole session (see e2e/README.md).

Every test here is marked ``e2e`` and left out of ``make test``'s default run; ``make e2e``
builds the Kubernetes programs and runs ``pytest -m e2e tests/e2e``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_nodes import NODES
from kube_cluster import REPO, Cluster, running_cluster

HERE = Path(__file__).parent
LOGS = REPO / "e2e" / "logs"
BUILD_IMAGE = REPO / "scripts" / "build_image.py"


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


@pytest.fixture(scope="session")
def gpushare_image() -> Path:
    """The image built with every stand-in (`make image-archive STANDINS=all`), checked, and
    written as a docker-archive tar, once per session (test_image.py, test_daemonset_real.py);
    ``GPUSHARE_E2E_IMAGE`` names an archive built before instead."""
    built = os.environ.get("GPUSHARE_E2E_IMAGE")
    if built:  # an archive `make image-archive STANDINS=all` wrote already (no build)
        return Path(built).resolve()
    if os.geteuid() != 0:
        pytest.fail("building the image needs root (buildah's storage, apt-get for the tools)")
    result = subprocess.run(
        [sys.executable, str(BUILD_IMAGE), "all", "--standins", "all"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    log = LOGS / "image-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (archive,) = [
        line.split()[1] for line in result.stdout.splitlines() if line.startswith("archive: ")
    ]
    return REPO / archive
