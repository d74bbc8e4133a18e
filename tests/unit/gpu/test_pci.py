"""NVML's PCI bus IDs name the same sysfs directory wherever gpushare looks one up:
one function spells them the kernel's way, and both of its users (the NUMA node of a
card, the PCIe root complex the DRA driver publishes) find the card through it."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gpushare.dra.part import pcie_root
from gpushare.gpu.nvml import _numa_node
from gpushare.gpu.pci import sysfs_bus_id

hexes = st.integers(min_value=0, max_value=0xFFFF)
buses = st.integers(min_value=0, max_value=0xFF)
devices = st.integers(min_value=0, max_value=0x1F)
functions = st.integers(min_value=0, max_value=7)


@given(hexes, buses, devices, functions, st.booleans())
def test_an_nvml_bus_id_becomes_the_sysfs_name(
    domain: int, bus: int, device: int, function: int, upper: bool
) -> None:
    nvml = f"0000{domain:04x}:{bus:02x}:{device:02x}.{function}"
    expected = f"{domain:04x}:{bus:02x}:{device:02x}.{function}"
    assert sysfs_bus_id(nvml.upper() if upper else nvml) == expected
    assert sysfs_bus_id(expected.upper()) == expected  # already sysfs-shaped: unchanged


def test_an_example_from_nvidia_smi() -> None:
    assert sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"


def sysfs_with_card(tmp_path: Path, name: str, numa: str) -> Path:
    """A sysfs as the kernel lays it out: the device under its root complex, and a link
    to it from /sys/bus/pci/devices."""
    real = tmp_path / "devices" / "pci0000:3a" / "0000:3a:00.0" / name
    real.mkdir(parents=True)
    (real / "numa_node").write_text(f"{numa}\n")
    listing = tmp_path / "bus" / "pci" / "devices"
    listing.mkdir(parents=True)
    (listing / name).symlink_to(real)
    return listing


def test_the_numa_node_and_the_pcie_root_are_found_from_the_nvml_bus_id(tmp_path: Path) -> None:
    sysfs = sysfs_with_card(tmp_path, "0000:3b:00.0", "1")
    assert _numa_node("00000000:3B:00.0", sysfs) == 1
    assert pcie_root("00000000:3B:00.0", sysfs) == "pci0000:3a"


def test_a_card_sysfs_does_not_show_has_neither(tmp_path: Path) -> None:
    sysfs = sysfs_with_card(tmp_path, "0000:3b:00.0", "-1")
    assert _numa_node("00000000:3B:00.0", sysfs) is None  # -1: no NUMA node
    assert _numa_node("00000000:86:00.0", sysfs) is None
    assert pcie_root("00000000:86:00.0", sysfs) is None
    assert pcie_root("", sysfs) is None
