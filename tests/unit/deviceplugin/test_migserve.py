"""MIG devices as exclusive resources: IDs, order, device nodes, the Allocate answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kit.mig_layouts import A100_UUID, mig_uuid, reference_a100

from gpushare.deviceplugin.migserve import (
    MissingCapability,
    device_specs,
    mig_answer,
    parse_mig_minors,
    read_device_specs,
    resources,
    socket_name,
)
from gpushare.gpu.gpus import SimulatedBackend
from gpushare.gpu.mig import MigPlan, MigStrategy, plan
from gpushare.node.enforcement import with_mig_names
from gpushare.share.answers import CDI_CRI, ENVVAR, DeviceListing, DeviceSpec

# As the driver writes it for GPU minor 0 with GPU instances 2, 3, 9, 10 (CI 0 each).
MIG_MINORS = """config 1
monitor 2
gpu0/gi2/access 21
gpu0/gi2/ci0/access 22
gpu0/gi3/access 30
gpu0/gi3/ci0/access 31
gpu0/gi9/access 84
gpu0/gi9/ci0/access 85
gpu0/gi10/access 93
gpu0/gi10/ci0/access 94
garbage line here
"""


def reference_plan(tmp_path: Path, strategy: MigStrategy = MigStrategy.MIXED) -> MigPlan:
    path = tmp_path / "n.yaml"
    path.write_text(yaml.safe_dump({"gpus": [reference_a100()]}))
    return plan(SimulatedBackend(path).discover(), strategy)


def test_resources_of_the_reference_layout(tmp_path: Path) -> None:
    served = dict(resources(reference_plan(tmp_path), "gpushare.io"))
    assert list(served) == [
        "gpushare.io/mig-1g.5gb",
        "gpushare.io/mig-2g.10gb",
        "gpushare.io/mig-3g.20gb",
    ]
    ones = served["gpushare.io/mig-1g.5gb"]
    assert list(ones.devices) == [mig_uuid(2), mig_uuid(3)]
    first = ones.devices[mig_uuid(2)]
    assert (first.parent, first.name, first.memory_mib, first.cdi_id, first.numa_node) == (
        A100_UUID, "1g.5gb", 4864, "0:2", 0
    )
    assert socket_name(ones) == "gpushare-mig-1g.5gb.sock"


def test_parse_mig_minors_keeps_only_name_number_lines() -> None:
    minors = parse_mig_minors(MIG_MINORS)
    assert minors["gpu0/gi9/ci0/access"] == 85 and minors["config"] == 1
    assert "garbage" not in " ".join(minors)


def test_device_specs_name_the_parent_and_both_capabilities(tmp_path: Path) -> None:
    device = reference_plan(tmp_path).exclusive["mig-1g.5gb"][0]
    specs = device_specs(device, 0, parse_mig_minors(MIG_MINORS), ["/dev/nvidiactl"])
    assert specs == (
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap84",
        "/dev/nvidia-caps/nvidia-cap85",
        "/dev/nvidiactl",
    )
    with pytest.raises(MissingCapability, match="gpu1/gi9/access or gpu1/gi9/ci0/access"):
        device_specs(device, 1, parse_mig_minors(MIG_MINORS))


def test_read_device_specs_from_files(tmp_path: Path) -> None:
    minors = tmp_path / "mig-minors"
    minors.write_text(MIG_MINORS.replace("gpu0/gi10/ci0/access 94\n", ""))
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia-uvm").write_text("")
    specs = read_device_specs(reference_plan(tmp_path), minors, dev)
    assert set(specs) == {mig_uuid(0), mig_uuid(1), mig_uuid(2)}  # gi 10's CI is missing
    assert specs[mig_uuid(0)][-1] == "/dev/nvidia-uvm"
    assert read_device_specs(reference_plan(tmp_path), tmp_path / "none", dev) == {}


def test_answer_names_the_mig_devices_and_adds_their_nodes_once(tmp_path: Path) -> None:
    ones = dict(resources(reference_plan(tmp_path), "gpushare.io"))["gpushare.io/mig-1g.5gb"]
    devices = list(ones.devices.values())
    specs = {
        mig_uuid(2): ["/dev/nvidia0", "/dev/nvidiactl"],
        mig_uuid(3): ["/dev/nvidia0", "/dev/nvidiactl"],
    }
    listing = DeviceListing(strategies=frozenset({ENVVAR, CDI_CRI}))
    answer = mig_answer(listing, specs=specs)(devices)
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": f"{mig_uuid(2)},{mig_uuid(3)}"}
    assert answer.cdi_devices == [f"nvidia.com/gpu={mig_uuid(2)}", f"nvidia.com/gpu={mig_uuid(3)}"]
    assert answer.device_specs == [
        DeviceSpec("/dev/nvidia0", "/dev/nvidia0", "rw"),
        DeviceSpec("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
    ]
    assert answer.mounts == []
    cdi_only = DeviceListing(strategies=frozenset({CDI_CRI}))
    by_index = mig_answer(with_mig_names(cdi_only, reference_plan(tmp_path), True))
    indexed = by_index(devices[:1])
    assert with_mig_names(cdi_only, reference_plan(tmp_path), False) == cdi_only
    assert indexed.cdi_devices == ["nvidia.com/gpu=0:2"] and indexed.device_specs == []
    assert indexed.envs == {"NVIDIA_VISIBLE_DEVICES": "void"}


def test_single_resource_socket_is_apart_from_whole_cards(tmp_path: Path) -> None:
    path = tmp_path / "n.yaml"
    card = reference_a100()
    card["instances"] = card["instances"][2:]
    path.write_text(yaml.safe_dump({"gpus": [card]}))
    served = dict(resources(plan(SimulatedBackend(path).discover(), MigStrategy.SINGLE), "x.io"))
    assert socket_name(served["x.io/gpu"]) == "gpushare-mig-gpu.sock"


def test_old_style_mig_uuids_of_the_reference_document_are_device_ids(tmp_path: Path) -> None:
    """Drivers before R470 named MIG devices ``MIG-GPU-<uuid>/<gi>/<ci>`` (the reference
    document's ``nvidia-smi -L`` shows one); they stay valid IDs and names."""
    card = reference_a100()
    for item in card["instances"]:
        item["uuid"] = f"MIG-{A100_UUID}/{item['gi']}/{item['ci']}"
    path = tmp_path / "n.yaml"
    path.write_text(yaml.safe_dump({"gpus": [card]}))
    served = dict(resources(plan(SimulatedBackend(path).discover(), MigStrategy.MIXED), "x.io"))
    two = served["x.io/mig-2g.10gb"]
    assert list(two.devices) == [f"MIG-{A100_UUID}/3/0"]
    listing = DeviceListing(strategies=frozenset({ENVVAR, CDI_CRI}))
    answer = mig_answer(listing)(list(two.devices.values()))
    assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == f"MIG-{A100_UUID}/3/0"
