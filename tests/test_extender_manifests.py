"""The extender's Deployment, Service and sample KubeSchedulerConfiguration agree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from gpushare.extender.server import parse_settings

HERE = Path(__file__).resolve().parent.parent / "daemonset" / "extender"


def _objects(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((HERE / name).read_text()) if doc]


def test_manifests_validate_against_kubernetes_1_32() -> None:
    for obj in _objects("extender.yaml"):
        kubernetes_validate.validate(obj, "1.32.0", strict=True)


def test_scheduler_config_reaches_the_extender_and_manages_both_resources() -> None:
    (config,) = _objects("scheduler-config.yaml")
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    (extender,) = config["extenders"]
    assert extender["ignorable"] is False
    assert extender["nodeCacheCapable"] is False
    assert {(r["name"], r["ignoredByScheduler"]) for r in extender["managedResources"]} == {
        ("gpushare.io/vcuda-memory", False),
        ("gpushare.io/vcuda-core", False),
    }
    assert extender["weight"] >= 1

    objects = {obj["kind"]: obj for obj in _objects("extender.yaml")}
    (port,) = objects["Service"]["spec"]["ports"]
    (container,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    settings, _ = parse_settings(container["args"])
    assert extender["urlPrefix"] == f"http://127.0.0.1:{port['nodePort']}{settings.url_prefix}"
    assert port["targetPort"] == container["ports"][0]["name"]
    assert container["ports"][0]["containerPort"] == settings.port
    assert (extender["filterVerb"], extender["prioritizeVerb"]) == ("filter", "prioritize")
    assert settings.resource_prefix == "gpushare.io"
