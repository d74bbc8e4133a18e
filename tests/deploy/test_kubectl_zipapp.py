"""``kubectl gpushare`` as one file for Python 3.9+ with nothing to install.

The test builds the zipapp (what ``make kubectl-plugin`` runs), then runs it with the
oldest Python it can find from 3.9 up (this machine's own when there is none) against the
API-server double: ``--help``, ``version`` and ``inspect``, with no site-packages (``-S``
``-E``: nothing installed is reachable). Every module in the archive must also parse as
Python 3.9, and the krew manifest names the archive by its sha256.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import yaml
from kit.cleanup_kubelet import CLEAN_REPORT, CleanupKubelet
from kit.kube_double import KubeApiDouble

from gpushare.kube import nodestate
from gpushare.probe import checks as probe

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import build_kubectl_plugin  # noqa: E402


@functools.lru_cache(maxsize=1)
def oldest_python() -> str:
    """python3.9 (or the next oldest 3.x >= 3.9) if installed, else this interpreter."""
    for minor in (9, 10, 11, 12, 13):
        candidates = [
            shutil.which(f"python3.{minor}"),
            *sorted(Path.home().glob(f".pyenv/versions/3.{minor}.*/bin/python3.{minor}")),
        ]
        for found in candidates:
            if (
                found
                and subprocess.run([str(found), "-c", "pass"], capture_output=True).returncode == 0
            ):
                return str(found)
    return sys.executable


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kubectl_plugin.build(tmp_path_factory.mktemp("plugin") / "kubectl-gpushare")


def run(
    plugin: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [oldest_python(), "-S", "-E", str(plugin), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", **(env or {})},
    )


def test_every_module_in_the_archive_parses_as_python_3_9(plugin: Path) -> None:
    with zipfile.ZipFile(plugin) as archive:
        names = [n for n in archive.namelist() if n.endswith(".py")]
        assert "gpushare/ops/kubectl.py" in names and "yaml/__init__.py" in names
        assert not any(n.startswith(("kubernetes/", "grpc/", "pynvml")) for n in names)
        for name in names:
            ast.parse(archive.read(name), filename=name, feature_version=(3, 9))


def test_help_and_version_run_with_nothing_installed(plugin: Path) -> None:
    help_ = run(plugin, "--help")
    assert help_.returncode == 0, help_.stderr
    for command in ("inspect", "verify", "install", "uninstall", "version"):
        assert command in help_.stdout
    version = run(plugin, "version")
    assert version.returncode == 0 and version.stdout.startswith("kubectl gpushare ")


def test_inspect_against_the_api_server_double(
    plugin: Path, api: KubeApiDouble, tmp_path: Path
) -> None:
    card = nodestate.CardState("GPU-1", 0, "Tesla P4", 7611, 29, 4, 100, 30, True)
    state = nodestate.NodeGpuState(3, "2026-11-25T00:00:00Z", 256, (card,))
    meta = {"name": "gpu-a", "annotations": {"gpushare.io/gpus": nodestate.encode(state)}}
    api.add({"apiVersion": "v1", "kind": "Node", "metadata": meta})
    config = api.kubeconfig(tmp_path / "kubeconfig")
    result = run(plugin, "inspect", env={"KUBECONFIG": str(config)})
    assert result.returncode == 0, result.stderr
    assert "NODE gpu-a  (1 card, 256 MiB units, generation 3" in result.stdout
    assert "1024/7424" in result.stdout
    missing = run(plugin, "inspect", env={"KUBECONFIG": str(tmp_path / "absent")})
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_every_manifest_install_reads_is_in_the_archive(plugin: Path) -> None:
    """The one-file plugin died with "Can't listdir a file" on install, uninstall and
    verify: the archive lacked manifests/policies/ (issue 33.1)."""
    shipped = ROOT / "src" / "gpushare" / "manifests"
    wanted = {f"gpushare/manifests/{p.relative_to(shipped)}" for p in shipped.rglob("*.yaml")}
    with zipfile.ZipFile(plugin) as archive:
        assert wanted <= set(archive.namelist())
    assert any("/policies/" in name for name in wanted)


def _finish_verify_pods(api: KubeApiDouble, stop: threading.Event) -> None:
    """Stands in for the node: each verify pod "succeeds" with an enforcing report."""
    done: set[str] = set()
    while not stop.wait(0.02):
        for key, obj in list(api.objects.items()):
            if "/pods/gpushare-verify-" in key and key not in done:
                done.add(key)
                api.logs[key] = probe.render([probe.Check("one card visible", True, "GPU-1")])
                with api._lock:
                    obj.setdefault("status", {})["phase"] = "Succeeded"


def test_every_subcommand_runs_from_the_built_file(
    plugin: Path, api: KubeApiDouble, tmp_path: Path
) -> None:
    """install, verify, inspect and uninstall (and their dry runs) from the archive, with
    nothing installed, against the API-server double: what the krew manifest ships."""
    gpu = {"name": "gpu-a", "labels": {"nvidia.com/gpu.present": "true"}}
    api.add({"apiVersion": "v1", "kind": "Node", "metadata": gpu,
             "status": {"allocatable": {"gpushare.io/vcuda-memory": "28"}}})  # fmt: skip
    env = {"KUBECONFIG": str(api.kubeconfig(tmp_path / "kubeconfig"))}

    def ok(*args: str) -> str:
        result = run(plugin, *args, env=env)
        assert result.returncode == 0, (args, result.stderr)
        assert "Traceback" not in result.stderr
        return result.stdout

    assert "dry run: nothing changed" in ok("install", "--dry-run", "--node", "gpu-a")
    first = ok("install", "--node", "gpu-a")
    assert "warning: no --image given" in first and "labelled node gpu-a" in first
    assert "created ValidatingAdmissionPolicy gpushare-daemon-node-scope" in first
    assert "unchanged ValidatingAdmissionPolicy" in ok("install", "--node", "gpu-a")
    upgrade = ok("install", "--node", "gpu-a", "--image", "reg.example/gs:1")
    assert "configured DaemonSet kube-system/gpushare" in upgrade
    stop = threading.Event()
    finisher = threading.Thread(target=_finish_verify_pods, args=(api, stop), daemon=True)
    finisher.start()
    try:
        verified = ok("verify", "--node", "gpu-a")  # the installed DaemonSet's image
        assert "(reg.example/gs:1;" in verified and "VERDICT: enforced" in verified
    finally:
        stop.set()
        finisher.join(5)
    refused = run(plugin, "verify", "--node", "gpu-a", "--core-units", "150", env=env)
    assert refused.returncode == 2 and "--core-units 150" in refused.stderr
    ok("inspect")
    assert "unlabel node gpu-a" in ok("uninstall", "--dry-run")
    with CleanupKubelet(api, CLEAN_REPORT).running():  # the node's kubelet, for its cleanup pod
        removed = ok("uninstall", "--all", "--wait", "0")
    assert "unlabelled node gpu-a" in removed
    assert "nothing of gpushare is left on gpu-a's host" in removed
    assert "deleted DaemonSet kube-system/gpushare" in removed
    script = run(plugin, "uninstall", env=env)
    assert script.returncode == 2 and "--all" in script.stderr


def test_the_krew_manifest_names_the_archive_by_its_digest(plugin: Path) -> None:
    archive, manifest = build_kubectl_plugin.krew_release(plugin, "https://example.org/rel/")
    doc = yaml.safe_load(manifest.read_text())
    assert doc["kind"] == "Plugin" and doc["metadata"]["name"] == "gpushare"
    (platform,) = doc["spec"]["platforms"]
    assert platform["uri"] == f"https://example.org/rel/{archive.name}"
    assert platform["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert platform["bin"] == "kubectl-gpushare"
    assert doc["spec"]["version"].startswith("v") and "$" not in manifest.read_text()
    assert os.access(plugin, os.X_OK)
