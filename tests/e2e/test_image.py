"""The image as it ships, built on this machine (`make image-archive STANDINS=all`).

CI pulls nothing from a registry, so every offline stand-in is used (a Debian base made by
mmdebstrap, the stub interposer, the memory hook built by the base's gcc); the builder is
what the machine has (docker with an engine, podman, or buildah, installed with apt-get if
none). The build, the checks that run each program from the image and the archive are
`scripts/build_image.py`'s; the archive is what the scenarios on a real containerd import
(`ctr -n k8s.io images import`). The build runs once per session (the second minor's run
is warm: the base and every layer are kept). The build is the session fixture
``gpushare_image`` (conftest.py), shared with test_daemonset_real.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kube_cluster import REPO

#: containerd, ctr, runc and the shim, as e2e/build-runtime.sh builds them (make e2e-build)
RUNTIME_BIN = Path(os.environ.get("GPUSHARE_E2E_RUNTIME_BIN") or REPO / "e2e" / "bin-runtime")


def _version() -> str:
    out = subprocess.run(
        ["make", "-s", "version"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    )
    return out.stdout.strip()


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


@pytest.fixture
def containerd(tmp_path: Path) -> Iterator[list[str]]:
    """A containerd of its own (root, state and socket in tmp_path; no CRI, no pod): the
    `ctr` command line that talks to it in the k8s.io namespace, as a kubelet's would."""
    missing = [p for p in ("containerd", "ctr", "runc", "containerd-shim-runc-v2")
               if not (RUNTIME_BIN / p).exists()]  # fmt: skip
    if missing:
        pytest.fail(f"missing {missing} in {RUNTIME_BIN}: run make e2e-build")
    socket = tmp_path / "containerd.sock"
    config = tmp_path / "containerd.toml"
    config.write_text(
        "version = 3\n"
        f'root = "{tmp_path / "root"}"\nstate = "{tmp_path / "state"}"\n'
        f'[grpc]\n  address = "{socket}"\n'
        # the image's layers copied, not overlaid: works on any file system the work dir is on
        '[plugins."io.containerd.cri.v1.images"]\n  snapshotter = "native"\n'
        '[plugins."io.containerd.grpc.v1.cri"]\n  disable = true\n'
        '[plugins."io.containerd.nri.v1.nri"]\n  disable = true\n'
    )
    env = {**os.environ, "PATH": f"{RUNTIME_BIN}:{os.environ['PATH']}"}
    log = (tmp_path / "containerd.log").open("w")
    proc = subprocess.Popen([str(RUNTIME_BIN / "containerd"), "--config", str(config)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    ctr = [str(RUNTIME_BIN / "ctr"), "--address", str(socket), "--namespace", "k8s.io"]
    try:
        # ready when it answers (its socket appears before the services are up)
        for _ in range(600):
            if subprocess.run([*ctr, "version"], capture_output=True, env=env).returncode == 0:
                break
            assert proc.poll() is None, (tmp_path / "containerd.log").read_text()[-2000:]
            subprocess.run(["sleep", "0.1"], check=True)
        yield ctr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def test_containerd_imports_the_archive_and_runc_runs_its_programs(
    gpushare_image: Path, containerd: list[str]
) -> None:
    """What a node does with the archive (docs/deploy.md#building-the-image): `ctr -n
    k8s.io images import`, then the DaemonSet's image reference `gpushare:<version>`
    resolves to it (docker.io/library/...) and runc runs the daemon and the init
    container's program from it."""
    env = {**os.environ, "PATH": f"{RUNTIME_BIN}:{os.environ['PATH']}"}

    def ctr(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*containerd, *args], capture_output=True, text=True, env=env,
                              timeout=600)  # fmt: skip

    imported = ctr("images", "import", str(gpushare_image))
    assert imported.returncode == 0, imported.stderr
    version = _version()
    names = ctr("images", "list", "--quiet").stdout.split()
    assert f"docker.io/library/gpushare:{version}" in names
    runc = ["--runc-binary", str(RUNTIME_BIN / "runc")]
    ran = ctr("run", "--rm", *runc, f"docker.io/library/gpushare:{version}", "daemon",
              "gpushare-device-plugin", "--version")  # fmt: skip
    assert ran.returncode == 0 and ran.stdout.strip() == f"gpushare-device-plugin {version}", ran
    init = ctr("run", "--rm", *runc, f"docker.io/library/gpushare:{version}", "init",
               "python", "-m", "gpushare.host.cachefs", "--help")  # fmt: skip
    assert init.returncode == 0 and "--size-mib" in init.stdout, init
