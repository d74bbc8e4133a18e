"""The DRA objects of the chart and of daemonset/dra/: they render, validate and agree
with the driver (its name, its sockets' directories, where it writes CDI specs)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_deploy_manifests import CHART, DAEMONSET_DIR, KUBE_VERSIONS, chart_objects

from gpushare.config import Settings
from gpushare.dra.model import DEFAULT_DRIVER

DEFAULTS = Settings()


def dra_values(**extra: Any) -> dict[str, Any]:
    return {
        "dra": {"enabled": True, "extendedResource": {"enabled": True}, **extra},
        "config": {"cardModes": "0=dra"},
    }


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_dra_chart_objects_validate(version: str) -> None:
    for obj in chart_objects(dra_values()):
        kubernetes_validate.validate(obj, version, strict=True)


def test_dra_chart_objects() -> None:
    objects = chart_objects(dra_values())
    classes = {o["metadata"]["name"]: o for o in objects if o["kind"] == "DeviceClass"}
    assert set(classes) == {"gpushare.io", "gpushare.io-gpu"}
    assert classes["gpushare.io-gpu"]["spec"]["extendedResourceName"] == "gpushare.io/gpu"
    for device_class in classes.values():
        expression = device_class["spec"]["selectors"][0]["cel"]["expression"]
        assert f'device.driver == "{DEFAULT_DRIVER}"' in expression
    (role,) = [
        o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-dra")
    ]
    rules = {r["resources"][0]: set(r["verbs"]) for r in role["rules"]}
    assert rules == {
        "resourceclaims": {"get"},
        "pods": {"get"},
        "resourceslices": {"get", "list", "create", "update", "delete"},
    }
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    root = DEFAULTS.dra_kubelet_root
    assert {
        f"{root}/plugins_registry",
        f"{root}/plugins/{DEFAULT_DRIVER}",
        DEFAULTS.dra_cdi_dir,
    } <= mounts
    policy = [o for o in objects if o["metadata"]["name"] == "gpushare-dra-node-scope"]
    assert [o["kind"] for o in policy] == [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]


def test_the_cdi_dir_is_mounted_once_writable_with_cdi_strategies() -> None:
    values = dra_values()
    values["config"]["deviceListStrategy"] = "cdi-cri"
    (daemonset,) = [o for o in chart_objects(values) if o["kind"] == "DaemonSet"]
    mounts = daemonset["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    at_cdi_dir = [m for m in mounts if m["mountPath"] == DEFAULTS.dra_cdi_dir]
    assert len(at_cdi_dir) == 1 and not at_cdi_dir[0].get("readOnly")


def test_without_dra_no_dra_objects() -> None:
    kinds = {o["kind"] for o in chart_objects()}
    assert "DeviceClass" not in kinds


def test_plain_manifests_name_the_default_driver() -> None:
    text = (DAEMONSET_DIR / "dra" / "deviceclasses.yaml").read_text()
    assert text.count(f'"{DEFAULT_DRIVER}"') >= 2
    docs = list(yaml.safe_load_all((DAEMONSET_DIR / "examples" / "dra-claims.yaml").read_text()))
    templates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceClaimTemplate"}
    share = templates["gpushare-4gib-30cores"]["spec"]["spec"]["devices"]["requests"][0]
    assert share["exactly"]["capacity"]["requests"] == {"memory": "4Gi", "cores": "30"}
    assert (CHART / "templates" / "dra.yaml").exists()
