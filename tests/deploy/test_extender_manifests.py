"""The two ways to run the extender agree with its code, and expose it to no one else.

kubeadm path: ``daemonset/extender/`` (a host-network DaemonSet on control-plane nodes
listening on 127.0.0.1) and the sample KubeSchedulerConfiguration.
Managed clusters: ``daemonset/scheduler/`` (kube-scheduler and the extender in one pod)
and the Helm chart's ``scheduler.enabled``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from kit import strict_yaml
from test_deploy_manifests import chart_objects, one, validate

from gpushare.extender.httpserver import parse_settings

ROOT = Path(__file__).resolve().parents[2]
EXTENDER = ROOT / "daemonset" / "extender"
SCHEDULER = ROOT / "daemonset" / "scheduler"
RESOURCES = {"gpushare.io/vcuda-memory", "gpushare.io/vcuda-core"}


def _objects(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in strict_yaml.load_all(path.read_text()) if doc]


def _kustomized(folder: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return [obj for name in kustomization["resources"] for obj in _objects(folder / name)]


def _check_extender_entry(extender: dict[str, Any], container: dict[str, Any]) -> None:
    """The scheduler calls the extender where it listens, for both resources, and
    lets it bind; the extender listens on 127.0.0.1 only."""
    settings, _ = parse_settings(container["args"])
    assert settings.address == "127.0.0.1"
    assert extender["urlPrefix"] == f"http://127.0.0.1:{settings.port}{settings.url_prefix}"
    assert (extender["filterVerb"], extender["prioritizeVerb"]) == ("filter", "prioritize")
    assert extender["bindVerb"] == "bind"
    assert extender["ignorable"] is False
    assert extender["nodeCacheCapable"] is True
    assert extender["enableHTTPS"] is False
    assert {(r["name"], r["ignoredByScheduler"]) for r in extender["managedResources"]} == {
        (name, False) for name in RESOURCES
    }
    assert extender["weight"] >= 1
    assert settings.resource_prefix == "gpushare.io"
    assert settings.max_body_bytes == 4 << 20
    assert "ports" not in container or all(
        p["containerPort"] != settings.port for p in container["ports"]
    )


def _hardened(pod_spec: dict[str, Any]) -> None:
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert pod_spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod_spec["containers"]:
        context = container["securityContext"]
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert "memory" in container["resources"]["limits"]


# -- kubeadm: the default scheduler calls the extender on its own node -----------------


def test_kubeadm_extender_listens_on_localhost_of_control_plane_nodes_only() -> None:
    objects = _kustomized(EXTENDER)
    for obj in objects:
        kubernetes_validate.validate(obj, "1.32.0", strict=True)
    assert "Service" not in {obj["kind"] for obj in objects}
    spec = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["nodeSelector"] == {"node-role.kubernetes.io/control-plane": ""}
    _hardened(spec)
    (container,) = spec["containers"]
    (config,) = _objects(EXTENDER / "scheduler-config.yaml")
    assert config["kind"] == "KubeSchedulerConfiguration"
    (extender,) = config["extenders"]
    _check_extender_entry(extender, container)
    settings, _ = parse_settings(container["args"])
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert (get["host"], get["port"]) == ("127.0.0.1", settings.port)
    # Its only rights: binding pods, listing and watching them (what occupies a card) and
    # the Nodes (their published cards, for requests by name).
    assert one(objects, "ClusterRole")["rules"] == [
        {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]},
    ]
    binding = one(objects, "ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == spec["serviceAccountName"]


# -- managed clusters: gpushare-scheduler ----------------------------------------------


def _scheduler_checks(objects: list[dict[str, Any]]) -> None:
    deployment = one(objects, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    _hardened(spec)
    containers = {c["name"]: c for c in spec["containers"]}
    assert set(containers) == {"kube-scheduler", "extender"}
    scheduler = containers["kube-scheduler"]
    assert scheduler["image"].startswith("registry.k8s.io/kube-scheduler:v1.")
    (flag,) = [a for a in scheduler["command"] if a.startswith("--config=")]
    config_path = Path(flag.split("=", 1)[1])
    (mount,) = scheduler["volumeMounts"]
    assert config_path.parent == Path(mount["mountPath"])
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    configmap = one(objects, "ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    config = yaml.safe_load(configmap["data"][config_path.name])
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["leaderElection"]["leaderElect"] is True
    lease = config["leaderElection"]["resourceName"]
    (profile,) = config["profiles"]
    assert profile["schedulerName"] == "gpushare-scheduler"
    (extender,) = config["extenders"]
    _check_extender_entry(extender, containers["extender"])
    settings, _ = parse_settings(containers["extender"]["args"])
    assert settings.probe_port and containers["extender"]["ports"] == [
        {"name": "probes", "containerPort": settings.probe_port, "protocol": "TCP"}
    ]
    # RBAC: kube-scheduler's own roles, the authentication reader, its own Lease.
    account = spec["serviceAccountName"]
    bound = {
        (b["kind"], b["roleRef"]["name"])
        for b in objects
        if b["kind"] in ("ClusterRoleBinding", "RoleBinding")
        and b["subjects"]
        == [{"kind": "ServiceAccount", "name": account, "namespace": "kube-system"}]
    }
    assert {role for _, role in bound} >= {
        "system:kube-scheduler",
        "system:volume-scheduler",
        "extension-apiserver-authentication-reader",
    }
    roles = [
        o
        for o in objects
        if o["kind"] == "Role" and o["metadata"]["name"].startswith("gpushare-scheduler")
    ]
    (role,) = [o for o in roles if o["rules"][0]["resources"] == ["leases"]]
    assert ("RoleBinding", role["metadata"]["name"]) in bound
    # the extender sidecar's list and watch of the daemons' state objects, nothing more
    (state_role,) = [o for o in roles if o is not role]
    assert ("RoleBinding", state_role["metadata"]["name"]) in bound
    assert state_role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list", "watch"]}
    ]
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [lease],
            "verbs": ["get", "update"],
        }
    ]
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "Service")]


def test_gpushare_scheduler_kustomization() -> None:
    objects = _kustomized(SCHEDULER)
    for obj in objects:
        kubernetes_validate.validate(obj, "1.32.0", strict=True)
    _scheduler_checks(objects)


def test_optional_mutating_policy_sends_gpushare_pods_to_gpushare_scheduler() -> None:
    policy, binding = _objects(SCHEDULER / "set-scheduler-name.yaml")
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"  # GA in 1.36
    assert policy["spec"]["failurePolicy"] == "Ignore"
    assert (
        '"gpushare-scheduler"' in policy["spec"]["mutations"][0]["applyConfiguration"]["expression"]
    )
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    kustomization = yaml.safe_load((SCHEDULER / "kustomization.yaml").read_text())
    assert "set-scheduler-name.yaml" not in kustomization["resources"]  # opt-in only


def test_chart_scheduler_is_off_by_default_and_matches_the_kustomization() -> None:
    assert not [
        o for o in chart_objects() if o["metadata"]["name"].startswith("gpushare-scheduler")
    ]
    objects = [
        o
        for o in chart_objects({"scheduler": {"enabled": True}})
        if "gpushare-scheduler" in o["metadata"]["name"] or o["kind"] in ("Role", "RoleBinding")
    ]
    _scheduler_checks(objects)
    deployment = one(objects, "Deployment")
    images = {c["name"]: c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert (
        images["extender"]
        == one(chart_objects(), "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["image"]
    )


@pytest.mark.parametrize(
    ("values", "tag"),
    # Helm renders offline as for its own client's Kubernetes minor (1.x.0).
    [({}, r"v1\.\d+\.0"), ({"scheduler": {"image": {"tag": "v1.31.4"}}}, r"v1\.31\.4")],
)
def test_chart_kube_scheduler_version_is_a_value(values: dict[str, Any], tag: str) -> None:
    merged: dict[str, Any] = {"scheduler": {"enabled": True, **values.get("scheduler", {})}}
    deployment = one([o for o in chart_objects(merged) if o["kind"] == "Deployment"], "Deployment")
    (scheduler,) = [
        c
        for c in deployment["spec"]["template"]["spec"]["containers"]
        if c["name"] == "kube-scheduler"
    ]
    assert re.fullmatch(f"registry\\.k8s\\.io/kube-scheduler:{tag}", scheduler["image"])


@pytest.mark.parametrize("version", ["1.35.0", "1.37.0"])
def test_chart_with_everything_on_validates(version: str) -> None:
    values = {"scheduler": {"enabled": True, "setSchedulerName": {"enabled": True}}}
    for obj in chart_objects(values):
        validate(obj, version)


def test_chart_mutating_policy_is_opt_in() -> None:
    kinds = {o["kind"] for o in chart_objects({"scheduler": {"enabled": True}})}
    assert "MutatingAdmissionPolicy" not in kinds
    values = {"scheduler": {"enabled": True, "setSchedulerName": {"enabled": True}}}
    policy = one(chart_objects(values), "MutatingAdmissionPolicy")
    assert policy == _objects(SCHEDULER / "set-scheduler-name.yaml")[0] | {
        "metadata": policy["metadata"]
    }


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"scheduler": {"bogus": 1}}, "bogus"),
        ({"scheduler": {"ledgerTimeoutSeconds": 0}}, "ledgerTimeoutSeconds"),
        ({"scheduler": {"extenderPort": 70000}}, "extenderPort"),
        ({"scheduler": {"setSchedulerName": {"apiVersion": "v2"}}}, "apiVersion"),
        ({"policies": {"coreNeedsMemory": {"enabled": "yes"}}}, "enabled"),
    ],
)
def test_the_chart_schema_refuses_bad_scheduler_and_policy_values(
    values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=where):
        chart_objects(values)


def test_the_chart_namespace_override_moves_the_scheduler_and_the_daemon_identity() -> None:
    values = {"namespaceOverride": "gpu-system", "scheduler": {"enabled": True}}
    objects = chart_objects(values)
    assert one(objects, "Deployment")["metadata"]["namespace"] == "gpu-system"
    scope = next(
        o for o in objects
        if o["kind"] == "ValidatingAdmissionPolicy" and "node-scope" in o["metadata"]["name"]
    )  # fmt: skip
    (condition,) = scope["spec"]["matchConditions"]
    assert "system:serviceaccount:gpu-system:gpushare'" in condition["expression"]
