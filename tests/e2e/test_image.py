"""The image as it ships, built on this machine (`make image-archive STANDINS=all`).

CI pulls nothing from a registry, so every offline stand-in is used (a Debian base made by
mmdebstrap, the stub interposer, the memory hook built by the base's gcc); the builder is
what the machine has (docker with an engine, podman, or buildah, installed with apt-get if
none). The build, the checks that run each program from the image and the archive are
`scripts/build_image.py`'s; the archive is what the scenarios on a real containerd import
(`ctr -n k8s.io images import`). The build runs once per session (the second minor's run
is warm: the base and every layer are kept).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from kube_cluster import REPO

SCRIPT = REPO / "scripts" / "build_image.py"


def _version() -> str:
    out = subprocess.run(
        ["make", "-s", "version"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    )
    return out.stdout.strip()


@pytest.fixture(scope="session")
def gpushare_image() -> Path:
    """The image built with every stand-in, checked, and written as a docker-archive tar."""
    if os.geteuid() != 0:
        pytest.fail("building the image needs root (buildah's storage, apt-get for the tools)")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "all", "--standins", "all"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    log = REPO / "e2e" / "logs" / "image-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (archive,) = [
        line.split()[1] for line in result.stdout.splitlines() if line.startswith("archive: ")
    ]
    return REPO / archive


def test_the_image_builds_offline_and_every_program_runs_from_it(gpushare_image: Path) -> None:
    text = (REPO / "e2e" / "logs" / "image-build.log").read_text()
    checks = [line for line in text.splitlines() if line.startswith(("ok  ", "FAIL"))]
    assert checks and all(line.startswith("ok  ") for line in checks), checks
    for what in (
        "daemon",
        "extender",
        "kubectl plugin",
        "interposer version",
        "memory hook usage",
        "memory hook check mode",
        "probe",
        "libvgpu.so hooks",
    ):
        assert any(line.startswith(f"ok   {what}:") for line in checks), what
    # the stand-ins say what they are
    assert "stub hook/libvgpu-stub.c" in text and "ENFORCES NOTHING" in text


def test_the_archive_is_one_image_containerd_can_import_by_its_name(gpushare_image: Path) -> None:
    with tarfile.open(gpushare_image) as tar:
        file = tar.extractfile("manifest.json")
        assert file is not None
        (entry,) = json.load(file)
        config = json.load(tar.extractfile(entry["Config"]))  # type: ignore[arg-type]
    version = _version()
    assert any(tag.endswith(f"gpushare:{version}") for tag in entry["RepoTags"]), entry
    assert config["config"]["Cmd"] == ["gpushare-device-plugin", "--log-format=json"]
    labels = config["config"]["Labels"]
    assert labels["io.gpushare.interposer"] == "stub"
    assert labels["io.gpushare.memory-hook-builder"] == "base"
    assert labels["org.opencontainers.image.version"] == version
    assert config["architecture"] == {"x86_64": "amd64", "aarch64": "arm64"}[os.uname().machine]
