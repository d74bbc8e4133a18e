"""Issue 33.2 and 33.8: ``kubectl gpushare`` commands are safe on the first try.

Destructive commands list what they will remove and ask on a terminal (the real console
script on a pseudo-terminal), refuse to remove everything from a script unless told
``--all``, and ``--dry-run`` changes nothing; ``install`` refuses an image string no
runtime could pull and warns when it labels a node that reports no GPU; a missing
kubeconfig is named. All against the API-server double, over HTTP.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kit.cleanup_kubelet import CLEAN_REPORT, CleanupKubelet
from kit.kube_double import KubeApiDouble

from gpushare.ops import deploy, imageref
from gpushare.ops.kubectl import main

OBJECTS = deploy.load_objects()
KEY, VALUE = deploy.opt_in_label(OBJECTS)
SCRIPT = Path(sys.executable).with_name("kubectl-gpushare")


def _node(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "labels": labels or {}}}


def _labels(api: KubeApiDouble, node: str) -> dict[str, str]:
    labels: dict[str, str] = (api.get("Node", node) or {})["metadata"].get("labels") or {}
    return labels


def _changes(api: KubeApiDouble) -> list[Any]:
    return [r for r in api.requests if r.method in ("PATCH", "DELETE", "POST", "PUT")]


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeApiDouble]:
    double = KubeApiDouble()
    double.start()
    double.add(_node("gpu-a", {"nvidia.com/gpu.present": "true"}))
    double.add(_node("gpu-b", {"nvidia.com/gpu.product": "Tesla-P4"}))
    double.add(_node("cpu-1", {"kubernetes.io/os": "linux"}))
    monkeypatch.setenv("KUBECONFIG", str(double.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # the nodes' kubelets, as far as uninstall's host cleanup pods go
    with CleanupKubelet(double, CLEAN_REPORT).running():
        yield double
    double.stop()


def _on_a_terminal(args: list[str], answer: bytes) -> subprocess.CompletedProcess[str]:
    """The console script with a pseudo-terminal as stdin, ``answer`` typed ahead."""
    controller, terminal = pty.openpty()
    try:
        os.write(controller, answer)
        return subprocess.run(
            [str(SCRIPT), *args],
            stdin=terminal,
            capture_output=True,
            text=True,
            timeout=60,
            env=os.environ.copy(),
        )
    finally:
        os.close(terminal)
        os.close(controller)


def test_uninstall_lists_what_it_removes_and_asks_on_a_terminal(api: KubeApiDouble) -> None:
    assert main(["install", "--node", "gpu-a", "--node", "gpu-b"]) == 0
    before = len(_changes(api))
    declined = _on_a_terminal(["uninstall"], b"n\n")
    assert declined.returncode == 1
    assert "not confirmed; nothing done" in declined.stderr
    out = declined.stdout
    assert "kubectl gpushare uninstall will:" in out
    assert f"unlabel node gpu-a ({KEY}={VALUE})" in out and "unlabel node gpu-b" in out
    assert "delete DaemonSet kube-system/gpushare" in out and "Go ahead? [y/N]" in out
    assert len(_changes(api)) == before and _labels(api, "gpu-a")[KEY] == VALUE

    named = _on_a_terminal(["uninstall", "--node", "gpu-a"], b"y\n")
    assert named.returncode == 0, named.stderr
    assert "keep the gpushare objects: still labelled: gpu-b" in named.stdout
    assert "delete " not in named.stdout.split("Go ahead?")[0]
    assert KEY not in _labels(api, "gpu-a") and _labels(api, "gpu-b")[KEY] == VALUE

    told = _on_a_terminal(["uninstall", "--yes"], b"")
    assert told.returncode == 0, told.stderr
    assert "Go ahead?" not in told.stdout
    assert "deleted DaemonSet kube-system/gpushare" in told.stdout
    assert KEY not in _labels(api, "gpu-b")


def test_uninstall_of_everything_from_a_script_needs_all(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--node", "gpu-a"]) == 0
    capsys.readouterr()
    before = len(api.requests)
    assert not sys.stdin.isatty()
    assert main(["uninstall"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--all" in err and "not a terminal" in err
    assert len(api.requests) == before  # refused before any request
    assert main(["uninstall", "--all", "--node", "gpu-a"]) == 2
    assert main(["uninstall", "--all", "--wait", "0"]) == 0
    assert KEY not in _labels(api, "gpu-a")


def test_dry_runs_change_nothing_and_say_what_would_happen(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--dry-run", "--node", "gpu-a"]) == 0
    out = capsys.readouterr().out
    assert _changes(api) == []
    assert "would create DaemonSet kube-system/gpushare" in out
    assert f"would label node gpu-a {KEY}={VALUE}" in out and "dry run: nothing changed" in out

    assert main(["install", "--node", "gpu-a"]) == 0
    capsys.readouterr()
    before = len(_changes(api))
    assert main(["install", "--dry-run", "--node", "gpu-a"]) == 0
    assert "would apply DaemonSet kube-system/gpushare" in capsys.readouterr().out
    assert main(["uninstall", "--dry-run"]) == 0  # no --all needed: it removes nothing
    out = capsys.readouterr().out
    assert "kubectl gpushare uninstall would:" in out and "unlabel node gpu-a" in out
    assert "delete ClusterRole gpushare" in out and "dry run: nothing changed" in out
    assert len(_changes(api)) == before and _labels(api, "gpu-a")[KEY] == VALUE


def test_install_refuses_an_image_no_runtime_could_pull_before_any_change(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    for bad in ("registry.example.com/GPUSHARE:1", "gpushare: 1", "https://reg/gpushare:1"):
        assert main(["install", "--node", "gpu-a", "--image", bad]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--image {bad!r}:" in err
    assert api.requests == []


def test_install_warns_when_it_labels_a_node_without_a_gpu(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--node", "cpu-1", "--node", "gpu-a"]) == 0
    out = capsys.readouterr().out
    assert "warning: node cpu-1 reports no NVIDIA GPU" in out
    assert "node gpu-a reports no" not in out
    assert _labels(api, "cpu-1")[KEY] == VALUE


@pytest.mark.parametrize("command", [["inspect"], ["install", "--node", "a"], ["verify",
                                     "--node", "a"], ["uninstall", "--all"]])  # fmt: skip
def test_a_missing_kubeconfig_is_named(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nonexistent"
    assert main(["--kubeconfig", str(missing), *command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err and "No such file" in err


# -- the image reference grammar ---------------------------------------------------------

VALID = [
    "gpushare:0.1.0",
    "registry.example.com/gpushare:0.1.0",
    "localhost:5000/team/gpushare",
    "nvcr.io/nvidia/k8s/cuda-sample:vectoradd-cuda12.5.0",
    "[::1]:5000/gpushare:v1",
    "ghcr.io/a__b/c-d.e:TAG_1" + "@sha256:" + "ab" * 32,
]
INVALID = ["", "upper/Case", "reg/Upper:1", "a b", "x::1", "reg/x:-tag", "http://reg/x",
           "reg/x@sha256:short", "reg//x", "x/", "/x", "x" * 256]  # fmt: skip


@pytest.mark.parametrize("reference", VALID)
def test_valid_references(reference: str) -> None:
    assert imageref.problem(reference) is None


@pytest.mark.parametrize("reference", INVALID)
def test_invalid_references(reference: str) -> None:
    assert imageref.problem(reference)


component = st.from_regex(r"[a-z0-9]{1,5}(?:[._-][a-z0-9]{1,5}){0,2}", fullmatch=True)


@given(
    host=st.sampled_from(["", "reg.example.com/", "localhost:5000/", "10.0.0.1:443/"]),
    path=st.lists(component, min_size=1, max_size=3),
    tag=st.one_of(st.just(""), st.from_regex(r":[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)),
)
def test_every_reference_the_grammar_builds_is_accepted(
    host: str, path: list[str], tag: str
) -> None:
    assert imageref.problem(host + "/".join(path) + tag) is None
