"""CDI: the device-list strategies of the Allocate answers, and the check that the
names handed out resolve in the node's CDI specs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TESLA_P4, Node, cards, gpu_uuid
from kit.cdi_runtime import final
from structlog.testing import capture_logs

from gpushare.config import ConfigError, load_settings
from gpushare.host.cdi import CdiCheck, read_specs
from gpushare.share.answers import CONTAINER_LIBRARY


def cdi_names(admitted: Any, resource: str) -> list[str]:
    return [d.name for d in admitted.responses[resource].cdi_devices]


def spec(kind: str, names: list[Any]) -> dict[str, Any]:
    return {
        "cdiVersion": "0.5.0",
        "kind": kind,
        "devices": [{"name": n, "containerEdits": {"deviceNodes": []}} for n in names],
    }


def start(node: Node, strategy: str, count: int = 2, **overrides: Any) -> None:
    spec_dir = node.root / "cdi"
    spec_dir.mkdir(exist_ok=True)
    node.start(
        cards(TESLA_P4, count),
        whole_cards=True,
        device_list_strategy=strategy,
        cdi_spec_dirs=str(spec_dir),
        **overrides,
    )
    assert node.kubelet.wait_for(lambda k: bool(k.devices(f"{node.settings.resource_prefix}/gpu")))


# ------------------------------------------------------------------ the strategies


def test_envvar_is_the_default_and_names_no_cdi_device(node: Node) -> None:
    node.start(cards(TESLA_P4, 1))
    admitted = node.kubelet.admit("a", "main", {node.memory: 2})
    assert admitted.envs["NVIDIA_VISIBLE_DEVICES"] == gpu_uuid(0)
    assert cdi_names(admitted, node.memory) == []
    assert not any(k.startswith("cdi.k8s.io/") for k in admitted.annotations)


def test_cdi_cri_names_the_card_and_keeps_the_limits_and_the_interposer(node: Node) -> None:
    start(node, "cdi-cri", count=1)
    admitted = node.kubelet.admit("a", "main", {node.memory: 2, node.core: 30})
    name = f"nvidia.com/gpu={gpu_uuid(0)}"
    # the card's name, then the grant's own CDI device, which carries the limits and the
    # interposer (doors/deviceplugin/test_cdi_grant_specs.py): the pod's env cannot shadow them
    memory, core = cdi_names(admitted, node.memory), cdi_names(admitted, node.core)
    assert memory[0] == core[0] == name
    assert memory[1].startswith("gpushare.io/grant=vcuda-memory-")
    assert core[1].startswith("gpushare.io/grant=vcuda-core-")
    env, mounts = final([], [], [memory[1], core[1]], [Path(node.settings.dra_cdi_dir)])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"  # an image's "all" exposes nothing
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "512m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert CONTAINER_LIBRARY in dict(mounts)
    assert admitted.envs == {} and admitted.conflicts == []


def test_cdi_annotations_name_the_cards_in_one_annotation(node: Node) -> None:
    start(node, "cdi-annotations")
    gpu = f"{node.settings.resource_prefix}/gpu"
    admitted = node.kubelet.admit("a", "main", {gpu: 2})
    (key,) = admitted.annotations
    assert key == f"cdi.k8s.io/gpushare_{gpu_uuid(0)}"
    *cards_named, grant = admitted.annotations[key].split(",")
    assert cards_named == [f"nvidia.com/gpu={gpu_uuid(0)}", f"nvidia.com/gpu={gpu_uuid(1)}"]
    # the grant's own CDI device last (doors/deviceplugin/test_cdi_every_door_sealed.py)
    assert grant.startswith("gpushare.io/grant=whole-")
    assert cdi_names(admitted, gpu) == []


def test_all_three_strategies_combine(node: Node) -> None:
    start(node, "envvar,cdi-cri,cdi-annotations")
    gpu = f"{node.settings.resource_prefix}/gpu"
    admitted = node.kubelet.admit("a", "main", {gpu: 2})
    assert admitted.envs == {}  # in the grant's own CDI spec, named last
    *cards_named, grant = cdi_names(admitted, gpu)
    assert cards_named == [f"nvidia.com/gpu={gpu_uuid(i)}" for i in range(2)]
    env, _mounts = final([], [], [grant], [Path(node.settings.dra_cdi_dir)])
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"{gpu_uuid(0)},{gpu_uuid(1)}"
    assert len([k for k in admitted.annotations if k.startswith("cdi.k8s.io/")]) == 1


def test_index_names_and_another_kind(node: Node) -> None:
    start(node, "cdi-cri", cdi_name_strategy="index", cdi_kind="example.com/accel")
    gpu = f"{node.settings.resource_prefix}/gpu"
    whole = node.kubelet.admit("a", "main", {gpu: 1})
    (card,) = whole.devices[gpu]
    index = [gpu_uuid(0), gpu_uuid(1)].index(card)
    assert cdi_names(whole, gpu)[:-1] == [f"example.com/accel={index}"]
    assert cdi_names(whole, gpu)[-1].startswith("gpushare.io/grant=whole-")
    shared = node.kubelet.admit("b", "main", {node.memory: 1})
    assert cdi_names(shared, node.memory)[0] == f"example.com/accel={1 - index}"


@pytest.mark.parametrize("strategy", ["", "envvar,volume-mounts", "cdi"])
def test_unknown_strategies_are_refused(strategy: str) -> None:
    with pytest.raises(ConfigError, match="device_list_strategy"):
        load_settings(["--device-list-strategy", strategy], environ={})


def test_a_cdi_kind_that_is_not_vendor_class_is_refused() -> None:
    with pytest.raises(ConfigError, match="cdi_kind"):
        load_settings([], environ={"GPUSHARE_CDI_KIND": "nvidia.com"})


# ------------------------------------------------------------------ the specs


def test_specs_are_read_from_yaml_and_json_and_bad_files_are_named(tmp_path: Path) -> None:
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir()
    run.mkdir()
    (etc / "nvidia.yaml").write_text(yaml.safe_dump(spec("nvidia.com/gpu", ["GPU-a", 0, "all"])))
    (run / "other.json").write_text(json.dumps(spec("example.com/x", ["y"])))
    (run / "broken.yaml").write_text("kind: [unclosed")
    (run / "notes.txt").write_text("ignored")
    (run / "nokind.yml").write_text(yaml.safe_dump({"devices": []}))
    scan = read_specs([etc, run, tmp_path / "absent"])
    assert scan.names == {
        "nvidia.com/gpu=GPU-a",
        "nvidia.com/gpu=0",
        "nvidia.com/gpu=all",
        "example.com/x=y",
    }
    assert len(scan.problems) == 2
    assert any("broken.yaml" in p for p in scan.problems)
    assert any("nokind.yml" in p and "kind" in p for p in scan.problems)


def test_unresolved_names_are_logged_once_and_cleared_when_a_spec_appears(tmp_path: Path) -> None:
    check = CdiCheck([tmp_path], ["nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"])
    with capture_logs() as logs:
        assert check.missing() == ["nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"]
        assert check.missing() == ["nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"]
    warnings = [e for e in logs if e["event"] == "cdi_names_unresolved"]
    assert len(warnings) == 1 and warnings[0]["missing"] == check.wanted
    (tmp_path / "nvidia.yaml").write_text(yaml.safe_dump(spec("nvidia.com/gpu", ["GPU-a"])))
    assert check.missing() == ["nvidia.com/gpu=GPU-b"]
    both = spec("nvidia.com/gpu", ["GPU-a", "GPU-b"])
    (tmp_path / "nvidia.yaml").write_text(yaml.safe_dump(both))
    with capture_logs() as logs:
        assert check.missing() == []
    assert [e["event"] for e in logs] == ["cdi_names_resolved"]


def test_readyz_says_which_cdi_names_do_not_resolve(node: Node) -> None:
    start(node, "cdi-cri")
    assert node.daemon is not None and node.daemon.plugin.link is not None
    assert node.daemon.plugin.link.registered.wait(30.0)
    ready, message = node.daemon.readiness()
    assert not ready
    assert f"nvidia.com/gpu={gpu_uuid(0)}" in message and f"nvidia.com/gpu={gpu_uuid(1)}" in message
    (node.root / "cdi" / "nvidia.yaml").write_text(
        yaml.safe_dump(spec("nvidia.com/gpu", [gpu_uuid(0), gpu_uuid(1), "all"]))
    )
    assert node.daemon.readiness() == (True, "serving and registered")


def test_envvar_alone_never_looks_at_cdi_specs(node: Node) -> None:
    start(node, "envvar")
    assert node.daemon is not None and node.daemon.plugin.cdi is None
    assert node.daemon.plugin.link is not None and node.daemon.plugin.link.registered.wait(30.0)
    assert node.daemon.readiness()[0]


# ------------------------------------------------------------------ the chart


def test_the_chart_mounts_the_cdi_spec_dirs_read_only_only_with_a_cdi_strategy() -> None:
    from test_deploy_manifests import _host_mounts, chart_objects, chart_values, one

    config = dict(chart_values()["config"])
    plain = _host_mounts(one(chart_objects({"config": config}), "DaemonSet"))
    assert "/etc/cdi" not in plain and "/var/run/cdi" not in plain
    config.update(deviceListStrategy="envvar,cdi-cri", cdiSpecDirs="/etc/cdi, /run/cdi2")
    mounts = _host_mounts(one(chart_objects({"config": config}), "DaemonSet"))
    assert mounts["/etc/cdi"] == ("/etc/cdi", True)
    assert mounts["/run/cdi2"] == ("/run/cdi2", True)
