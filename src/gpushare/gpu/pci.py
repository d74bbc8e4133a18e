"""PCI addresses of the cards: NVML spells them one way, the kernel's sysfs another."""

from __future__ import annotations

from pathlib import Path

#: Where the kernel lists the PCI devices, one directory per sysfs bus ID.
SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` (a 32-bit domain, upper case) as sysfs names it:
    ``0000:3b:00.0`` (a 16-bit domain, lower case). A bus ID already in sysfs form is
    returned unchanged but for its case."""
    domain, _, rest = nvml_bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower()
