"""The chart's values.schema.json refuses unknown keys and bad values, and every
new value renders into objects that validate offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from test_deploy_manifests import CHART, KUBE_VERSIONS, chart_objects, chart_values, one

from gpushare.config import ConfigError, load_settings
from gpushare.ops.chartschema import config_schema

SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def rejected(values: dict[str, Any]) -> str:
    """Helm's refusal of these values (empty if it rendered them)."""
    try:
        chart_objects(values)
    except helm_python.HelmValuesError as exc:
        return str(exc)
    return ""


def test_the_config_section_is_generated_from_the_daemons_options() -> None:
    assert SCHEMA["properties"]["config"] == config_schema()
    assert SCHEMA["additionalProperties"] is False


def test_the_schema_accepts_the_default_values() -> None:
    assert rejected({}) == ""
    assert set(chart_values()) == set(SCHEMA["properties"])  # every value has a schema


@pytest.mark.parametrize(
    "values,where",
    [
        ({"config": {"bogusKey": 1}}, "bogusKey"),
        ({"bogusTopLevel": 1}, "bogusTopLevel"),
        ({"config": {"memoryUnitMib": [1, 2]}}, "memoryUnitMib"),
        ({"config": {"memoryUnitMib": 0}}, "memoryUnitMib"),
        ({"config": {"memoryUnitMib": 2.5}}, "memoryUnitMib"),
        ({"config": {"metricsPort": 70000}}, "metricsPort"),
        ({"config": {"gcGraceSeconds": -1}}, "gcGraceSeconds"),
        ({"config": {"podResourcesIntervalSeconds": 0}}, "podResourcesIntervalSeconds"),
        ({"config": {"placement": "random"}}, "placement"),
        ({"config": {"logLevel": "loud"}}, "logLevel"),
        ({"config": {"resourcePrefix": "Not_A_Domain"}}, "resourcePrefix"),
        ({"config": {"ignoredXids": "a,b"}}, "ignoredXids"),
        ({"config": {"noEnforcement": "yes"}}, "noEnforcement"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"image": {"tags": "1"}}, "tags"),
        ({"updateStrategy": {"type": "Rolling"}}, "updateStrategy"),
        ({"extraArgs": ["log-level=debug"]}, "extraArgs"),
        ({"extraEnv": [{"value": "x"}]}, "extraEnv"),
        ({"serviceMonitor": {"enabled": "yes"}}, "serviceMonitor"),
        ({"serviceMonitor": {"interval": "soon"}}, "interval"),
        ({"namespaceOverride": "Kube_System"}, "namespaceOverride"),
        ({"nodeSelector": {"a": 1}}, "nodeSelector"),
        ({"optInLabel": {"key": "bad key", "value": "true"}}, "optInLabel"),
    ],
)
def test_the_schema_refuses_unknown_keys_and_bad_values(values: dict[str, Any], where: str) -> None:
    message = rejected(values)
    assert message, f"rendered: {values}"
    assert where in message


#: Values per option that the schema and the daemon must judge alike.
CASES: dict[str, list[Any]] = {
    "memoryUnitMib": [1, 256, 1 << 20, 0, -1, (1 << 20) + 1, "256"],
    "metricsPort": [0, 65535, 65536, -1],
    "healthRecoverySeconds": [1, 300.0, 604800, 0.5, 604801, "x"],
    "podResourcesIntervalSeconds": [1, 3600, 0, 3601],
    "gcGraceSeconds": [1.0, 0, -3],
    "resourcePrefix": ["gpushare.io", "baidu.com", "a", "Upper.io", "a/b", "-a.io", ""],
    "ignoredXids": ["13,31", "all", "ALL", "", [13, 31], ["x"], "13;31"],
    "placement": ["binpack", "spread", "fill"],
    "noEnforcement": [True, False, "true"],
    "kubeletDir": ["/var/lib/kubelet/device-plugins", ""],
}


@pytest.mark.parametrize(
    "key,value",
    [(key, value) for key, values in CASES.items() for value in values],
    ids=lambda v: repr(v),
)
def test_the_schema_and_the_daemon_judge_a_value_alike(
    key: str, value: Any, tmp_path: Path
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({key: value}))
    try:
        load_settings([f"--config={config}"], {})
        daemon_accepts = True
    except ConfigError:
        daemon_accepts = False
    helm_accepts = rejected({"config": {key: value}}) == ""
    assert helm_accepts == daemon_accepts  # exactly the same values


GOOD = {
    "namespaceOverride": "gpu-system",
    "nodeSelector": {"kubernetes.io/arch": "arm64"},
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["T4"]}
                        ]
                    }
                ]
            }
        }
    },
    "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}},
    "podLabels": {"team": "ml"},
    "extraEnv": [{"name": "EXTRA", "value": "1"}],
    "extraArgs": ["--log-level=debug"],
    "podSecurityContext": {"seccompProfile": {"type": "RuntimeDefault"}, "fsGroup": 0},
    "securityContext": {
        "runAsUser": 0,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["DAC_OVERRIDE", "FOWNER"]},
    },
    "metrics": {"service": {"enabled": True}},
    "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
    "podMonitor": {"enabled": True},
    "scheduler": {"replicas": 2},
}


CLUSTER_SCOPED = (
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_new_value_renders_and_validates(version: str) -> None:
    objects = chart_objects(GOOD)
    builtin = [o for o in objects if not o["apiVersion"].startswith("monitoring.coreos.com/")]
    for obj in builtin:
        kubernetes_validate.validate(obj, version, strict=True)
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == "gpu-system", obj["kind"]
    daemonset = one(objects, "DaemonSet")
    pod = daemonset["spec"]["template"]
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert spec["nodeSelector"] == {"kubernetes.io/arch": "arm64", "gpushare.io/enabled": "true"}
    assert spec["affinity"] == GOOD["affinity"]
    assert daemonset["spec"]["updateStrategy"] == GOOD["updateStrategy"]
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert {"name": "EXTRA", "value": "1"} in container["env"]
    assert container["args"] == ["--config=/etc/gpushare/config.yaml", "--log-level=debug"]
    assert GOOD["podSecurityContext"].items() <= spec["securityContext"].items()
    # Helm merges maps with the defaults: the given keys win, the others stay
    given = dict(GOOD["securityContext"])
    capabilities = given.pop("capabilities")
    assert given.items() <= container["securityContext"].items()
    # the given capabilities, and SYS_ADMIN for the driver self-test (memoryEnforcement auto)
    assert container["securityContext"]["capabilities"] == {
        "drop": capabilities["drop"],
        "add": [*capabilities["add"], "SYS_ADMIN"],
    }
    assert one(objects, "ClusterRoleBinding")["subjects"][0]["namespace"] == "gpu-system"
    service = one(objects, "Service")
    assert service["spec"]["ports"][0]["port"] == 9445
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    monitor = one(objects, "ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}
    ]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    pod_monitor = one(objects, "PodMonitor")
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert {p["name"] for p in container["ports"]} == {"metrics"}


def test_monitors_without_a_metrics_port_are_refused() -> None:
    with pytest.raises(helm_python.HelmError, match=r"config\.metricsPort"):
        chart_objects({"podMonitor": {"enabled": True}, "config": {"metricsPort": 0}})
    with pytest.raises(helm_python.HelmError, match=r"needs metrics\.service\.enabled"):
        chart_objects({"serviceMonitor": {"enabled": True}})
