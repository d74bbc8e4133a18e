"""``kubectl gpushare install|uninstall`` against a test double of the API server (HTTP)."""

from __future__ import annotations

import json
import os
import pty
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kit.cleanup_kubelet import CLEAN_REPORT, CleanupKubelet
from kit.kube_double import KubeApiDouble

from gpushare import __version__
from gpushare.config import Settings
from gpushare.kube import nodestate, stateobject
from gpushare.kube.kubectlapi import FIELD_MANAGER
from gpushare.ops import deploy
from gpushare.ops.kubectl import choose_nodes, main

OBJECTS = deploy.load_objects()
KEY, VALUE = deploy.opt_in_label(OBJECTS)
PREFIX = Settings().resource_prefix
SCRIPT = Path(sys.executable).with_name("kubectl-gpushare")


def _node(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "labels": labels or {}}}


def _stored(api: KubeApiDouble, obj: dict[str, Any]) -> dict[str, Any] | None:
    meta = obj["metadata"]
    return api.get(obj["kind"], meta["name"], meta.get("namespace"), obj["apiVersion"])


def _labels(api: KubeApiDouble, node: str) -> dict[str, str]:
    labels: dict[str, str] = (api.get("Node", node) or {})["metadata"].get("labels") or {}
    return labels


def _deletes(api: KubeApiDouble) -> list[Any]:
    """The DELETE calls, but those of uninstall's host cleanup pods (test_hostcleanup.py)."""
    return [r for r in api.calls("DELETE") if "/pods/gpushare-host-cleanup-" not in r.path]


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


def test_the_shipped_objects_are_the_daemonset_its_rbac_and_its_policies() -> None:
    assert [obj["kind"] for obj in OBJECTS] == [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",  # the node's state object, in the daemon's namespace
        "RoleBinding",
        "DaemonSet",
        "NetworkPolicy",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    assert (KEY, VALUE) == ("gpushare.io/enabled", "true")


def test_install_applies_the_node_scope_policy_where_served_and_warns_where_not(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    """The daemon's token is narrowed to its own node by default."""
    assert main(["install", "--node", "gpu-a"]) == 0
    group = "admissionregistration.k8s.io/v1"
    scope = api.get("ValidatingAdmissionPolicy", "gpushare-daemon-node-scope", None, group)
    assert scope is not None
    assert "WARNING" not in capsys.readouterr().out
    older = KubeApiDouble()  # a 1.29 cluster: no admissionregistration.k8s.io/v1 policies
    older.groups.pop("admissionregistration.k8s.io/v1")
    older.start()
    try:
        older.add(_node("gpu-a"))
        path = Path(os.environ["KUBECONFIG"]).with_name("older")
        os.environ["KUBECONFIG"] = str(older.kubeconfig(path))
        assert main(["install", "--node", "gpu-a"]) == 0
        out = capsys.readouterr().out
        assert "WARNING" in out and "gpushare-daemon-node-scope" in out
        assert "NOT installed" in out and "may then patch every Node and Pod" in out
        assert "created DaemonSet kube-system/gpushare" in out
        assert not older.calls("PATCH", "validatingadmissionpolic")
    finally:
        older.stop()


def test_install_applies_every_object_and_labels_the_named_nodes(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--node", "gpu-a", "--node", "gpu-b"]) == 0
    for obj in OBJECTS:
        stored = _stored(api, obj)
        assert stored is not None, obj["kind"]
        assert stored["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kubectl-gpushare"
        assert stored.get("spec", stored.get("rules")) == obj.get("spec", obj.get("rules"))
    applies = api.calls("PATCH", "/apis/") + api.calls("PATCH", "/serviceaccounts/")
    assert len(applies) == len(OBJECTS)
    for request in applies:
        assert request.content_type == "application/apply-patch+yaml"
        assert request.query["fieldManager"] == [FIELD_MANAGER]
        assert request.query["force"] == ["true"]
    assert _labels(api, "gpu-a")[KEY] == VALUE
    assert _labels(api, "gpu-b")[KEY] == VALUE
    assert KEY not in _labels(api, "cpu-1")
    out = capsys.readouterr().out
    assert "created DaemonSet kube-system/gpushare" in out
    assert "labelled node gpu-a" in out


def test_install_twice_changes_nothing_the_second_time(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--node", "gpu-a"]) == 0
    versions = {obj["kind"]: _stored(api, obj)["metadata"]["resourceVersion"] for obj in OBJECTS}  # type: ignore[index]
    node_version = api.get("Node", "gpu-a")["metadata"]["resourceVersion"]  # type: ignore[index]
    capsys.readouterr()
    before = len(api.requests)

    assert main(["install", "--node", "gpu-a"]) == 0
    again = {obj["kind"]: _stored(api, obj)["metadata"]["resourceVersion"] for obj in OBJECTS}  # type: ignore[index]
    assert again == versions
    assert api.get("Node", "gpu-a")["metadata"]["resourceVersion"] == node_version  # type: ignore[index]
    assert not [
        r
        for r in api.requests[before:]
        if r.path.startswith("/api/v1/nodes/") and r.method == "PATCH"
    ]
    out = capsys.readouterr().out
    assert out.count("unchanged ") == len(OBJECTS)
    assert "node gpu-a already labelled" in out


def test_install_sets_image_and_runtime_class_and_a_later_install_keeps_them(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    (shipped,) = [obj for obj in OBJECTS if obj["kind"] == "DaemonSet"]

    def pod_spec() -> dict[str, Any]:
        stored = _stored(api, shipped)
        assert stored is not None
        spec: dict[str, Any] = stored["spec"]["template"]["spec"]
        return spec

    image = "registry.example.com/gpushare:0.1.0"
    assert main(["install", "--node", "gpu-a", "--image", image, "--runtime-class", "nvidia"]) == 0
    assert pod_spec()["containers"][0]["image"] == image
    assert pod_spec()["runtimeClassName"] == "nvidia"
    capsys.readouterr()
    assert main(["install", "--node", "gpu-b"]) == 0  # one more node: nothing reverted
    assert pod_spec()["containers"][0]["image"] == image
    assert pod_spec()["runtimeClassName"] == "nvidia"
    assert "unchanged DaemonSet kube-system/gpushare" in capsys.readouterr().out
    assert (
        main(["install", "--image", "registry.example.com/gpushare:0.2.0", "--node", "gpu-a"]) == 0
    )
    assert pod_spec()["containers"][0]["image"] == "registry.example.com/gpushare:0.2.0"


def test_install_refuses_to_take_over_objects_it_did_not_create(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    daemonset = next(obj for obj in OBJECTS if obj["kind"] == "DaemonSet")
    api.add({**daemonset, "metadata": {**daemonset["metadata"], "labels": {"owner": "helm"}}})
    assert main(["install", "--node", "gpu-a"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "DaemonSet kube-system/gpushare" in err and "not created by kubectl-gpushare" in err
    assert api.calls("PATCH") == []
    assert _stored(api, daemonset)["metadata"]["labels"] == {"owner": "helm"}  # type: ignore[index]


def test_install_on_an_unknown_node_changes_nothing(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--node", "gpu-a", "--node", "nope"]) == 1
    assert "no such node: nope" in capsys.readouterr().err
    assert api.calls("PATCH") == []


def test_install_without_node_and_without_a_terminal_refuses(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not sys.stdin.isatty()
    assert main(["install"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--node" in err and "not a terminal" in err
    assert api.requests == []


def test_install_without_node_asks_on_a_terminal(api: KubeApiDouble) -> None:
    """The real console script, its stdin a pseudo-terminal: GPU nodes listed, one picked."""
    controller, terminal = pty.openpty()
    try:
        os.write(controller, b"2\n")
        done = subprocess.run(
            [str(SCRIPT), "install"],
            stdin=terminal,
            capture_output=True,
            text=True,
            timeout=60,
            env=os.environ.copy(),
        )
    finally:
        os.close(terminal)
        os.close(controller)
    assert done.returncode == 0, done.stderr
    listing = done.stdout.split("Install gpushare on which nodes?")[0]
    assert "1  gpu-a" in listing and "2  gpu-b" in listing
    assert "cpu-1" not in listing
    assert _labels(api, "gpu-b")[KEY] == VALUE
    assert KEY not in _labels(api, "gpu-a")


def test_choose_nodes_by_number_name_or_all() -> None:
    nodes = ["gpu-a", "gpu-b", "gpu-c"]
    assert choose_nodes(nodes, "3, 1") == ["gpu-c", "gpu-a"]
    assert choose_nodes(nodes, "gpu-b 2") == ["gpu-b"]
    assert choose_nodes(nodes, "all") == nodes
    assert choose_nodes(nodes, "") == []
    with pytest.raises(ValueError):
        choose_nodes(nodes, "4")
    with pytest.raises(ValueError):
        choose_nodes(nodes, "cpu-1")


def test_uninstall_keeps_the_objects_while_a_node_is_labelled_then_removes_them(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--node", "gpu-a", "--node", "gpu-b"]) == 0
    # What the daemon publishes on its node goes too.
    api.add(
        {
            **api.get("Node", "gpu-a"),  # type: ignore[dict-item]
            "metadata": {
                **api.get("Node", "gpu-a")["metadata"],  # type: ignore[index]
                "annotations": {nodestate.annotation_key(PREFIX): "{}", "keep": "me"},
            },
        }
    )
    node = api.get("Node", "gpu-a")
    node["metadata"]["labels"][nodestate.label_key(PREFIX, "product")] = "Tesla-P4"  # type: ignore[index]
    api.add(node)  # type: ignore[arg-type]
    foreign = {
        "kind": "ClusterRole",
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "metadata": {"name": "someone-else", "labels": {"app.kubernetes.io/part-of": "gpushare"}},
        "rules": [],
    }
    api.add(foreign)
    uid = api.get("Node", "gpu-a")["metadata"]["uid"]  # type: ignore[index]
    api.add(stateobject.state_object(PREFIX, "kube-system", "gpu-a", uid, "{}"))
    capsys.readouterr()

    assert main(["uninstall", "--node", "gpu-a"]) == 0
    # the node's state object went with what the daemon published on the Node
    assert api.get("ConfigMap", "gpushare-node-gpu-a", "kube-system") is None
    assert [r.path for r in _deletes(api)] == [
        "/api/v1/namespaces/kube-system/configmaps/gpushare-node-gpu-a"
    ]
    api.requests.clear()
    labels = _labels(api, "gpu-a")
    assert KEY not in labels and nodestate.label_key(PREFIX, "product") not in labels
    assert "nvidia.com/gpu.present" in labels  # not ours
    assert api.get("Node", "gpu-a")["metadata"]["annotations"] == {"keep": "me"}  # type: ignore[index]
    assert _labels(api, "gpu-b")[KEY] == VALUE
    assert all(_stored(api, obj) is not None for obj in OBJECTS)
    assert _deletes(api) == []
    out = capsys.readouterr().out
    assert "still labelled: gpu-b" in out
    assert "deleted ConfigMap kube-system/gpushare-node-gpu-a" in out

    assert main(["uninstall", "--all"]) == 0
    assert KEY not in _labels(api, "gpu-b")
    assert all(_stored(api, obj) is None for obj in OBJECTS)
    assert api.get("ClusterRole", "someone-else", None, "rbac.authorization.k8s.io/v1") is not None
    assert len(_deletes(api)) == len(OBJECTS)

    deletes = len(_deletes(api))
    assert main(["uninstall", "--all"]) == 0  # nothing left to do
    assert len(_deletes(api)) == deletes


def _daemon_pod(node: str) -> dict[str, Any]:
    (daemonset,) = [obj for obj in OBJECTS if obj["kind"] == "DaemonSet"]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": f"gpushare-{node}",
            "namespace": daemonset["metadata"]["namespace"],
            "labels": dict(daemonset["spec"]["template"]["metadata"]["labels"]),
        },
        "spec": {"nodeName": node},
    }


def test_uninstall_clears_what_the_daemon_published_only_once_its_pod_has_gone(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--node", "gpu-a", "--node", "gpu-b"]) == 0
    product = nodestate.label_key(PREFIX, "product")
    count = nodestate.label_key(PREFIX, "count")
    for name in ("gpu-a", "gpu-b"):
        node = api.get("Node", name)
        node["metadata"]["labels"].update({product: "Tesla-P4", count: "1"})  # type: ignore[index]
        api.add(node)  # type: ignore[arg-type]
    api.add(_daemon_pod("gpu-a"))  # the DaemonSet controller has not removed it yet
    finished = _daemon_pod("gpu-b")
    finished["status"] = {"phase": "Succeeded"}  # stopped: it publishes nothing any more
    api.add(finished)
    capsys.readouterr()

    assert main(["uninstall", "--all", "--wait", "0.3"]) == 0
    out = capsys.readouterr().out
    assert KEY not in _labels(api, "gpu-a") and KEY not in _labels(api, "gpu-b")
    assert _labels(api, "gpu-a")[product] == "Tesla-P4"  # a running daemon could restore it
    assert "the gpushare pod still runs on gpu-a" in out and "run uninstall again" in out
    assert product not in _labels(api, "gpu-b")
    assert "removed what the daemon published on gpu-b" in out
    assert all(_stored(api, obj) is None for obj in OBJECTS)

    pod = _daemon_pod("gpu-a")["metadata"]
    api.delete("Pod", pod["name"], pod["namespace"])
    assert main(["uninstall", "--all", "--wait", "0.3"]) == 0  # again, as the message says
    assert product not in _labels(api, "gpu-a") and count not in _labels(api, "gpu-a")
    assert "removed what the daemon published on gpu-a" in capsys.readouterr().out


def test_uninstall_never_deletes_objects_it_did_not_create(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    for obj in OBJECTS:  # as `kubectl apply -k daemonset/` leaves them
        api.add(dict(obj))
    assert main(["uninstall", "--all"]) == 0
    assert _deletes(api) == []
    assert all(_stored(api, obj) is not None for obj in OBJECTS)
    lines = capsys.readouterr().out.splitlines()
    for said in ("  keep ", "kept "):  # in the plan shown first, then as it goes
        told = [line for line in lines if line.startswith(said)]
        assert len(told) == len(OBJECTS)
        assert all(line.endswith(": not created by kubectl-gpushare") for line in told)


@pytest.mark.parametrize("command", [["install", "--node", "gpu-a"], ["uninstall", "--all"]])
def test_no_kubeconfig_is_one_line_and_exit_2(
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"kubectl gpushare {command[0]}: no usable kubeconfig")


@pytest.mark.parametrize("command", [["install", "--node", "gpu-a"], ["uninstall", "--all"]])
def test_unreachable_api_server_is_one_line_and_exit_2(
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    double = KubeApiDouble()
    double.start()
    config = double.kubeconfig(tmp_path / "kubeconfig")
    double.stop()
    config.write_text(config.read_text().replace(double.url, f"http://127.0.0.1:{port}"))
    monkeypatch.setenv("KUBECONFIG", str(config))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"cannot reach the API server at http://127.0.0.1:{port}" in err


def test_console_script_dispatches_inspect_and_fails_in_one_line_without_a_cluster(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "missing")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    for command, prog in ((["inspect"], "inspect"), (["uninstall", "--all"], "uninstall")):
        done = subprocess.run(
            [str(SCRIPT), *command], capture_output=True, text=True, timeout=60, env=env
        )
        assert done.returncode == 2
        assert done.stderr.count("\n") == 1
        assert done.stderr.startswith(f"kubectl gpushare {prog}: ")


def test_an_api_error_is_one_line_and_exit_1(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    api.fail_next(1, status=403)
    assert main(["install", "--node", "gpu-a"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("kubectl gpushare install: 403 Forbidden: injected failure")
    assert api.calls("PATCH") == []


def test_uninstall_removes_the_mig_labels_and_nothing_else(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--node", "gpu-a"]) == 0
    mig_labels = {
        f"{PREFIX}/mig.strategy": "mixed",
        f"{PREFIX}/mig-1g.5gb.count": "2",
        f"{PREFIX}/mig-1g.10gb.me.memory": "9984",
        f"{PREFIX}/mig-3g.20gb.multiprocessors": "42",
    }
    others = {f"{PREFIX}/mig-note": "x", "nvidia.com/mig-1g.5gb.count": "2", "team": "a"}
    node = api.get("Node", "gpu-a")
    node["metadata"]["labels"].update({**mig_labels, **others})  # type: ignore[index]
    api.add(node)  # type: ignore[arg-type]
    assert main(["uninstall", "--all", "--wait", "0"]) == 0
    labels = _labels(api, "gpu-a")
    assert not set(mig_labels) & set(labels)
    assert {k: labels.get(k) for k in others} == others


@pytest.mark.parametrize(
    "argv", [["--help"], ["version"], ["--version"], ["inspect", "--help"], ["install", "-h"]]
)
def test_help_and_version_import_nothing_of_the_kubernetes_client(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gpushare.ops.kubectl", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert imported and not [name for name in imported if name.startswith("kubernetes")]
    assert not [name for name in imported if name.startswith("grpc")]


def test_version_outputs() -> None:
    def run(*argv: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "gpushare.ops.kubectl", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert run("version") == run("--version") == f"kubectl gpushare {__version__}\n"
    assert json.loads(run("version", "-o", "json"))["clientVersion"]["version"] == __version__
    assert yaml.safe_load(run("version", "-o", "yaml"))["clientVersion"]["version"] == __version__


def test_a_bad_command_line_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpushare.ops.kubectl", "inspect", "-o", "xml"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "invalid choice: 'xml'" in done.stderr
