"""What gpushare knows about the GPUs: one record per card and MIG device, the events a
backend delivers, and the :class:`GpuBackend` protocol both backends implement.

The backends: :mod:`gpushare.gpu.nvml` (the real cards; the only daemon module that
imports ``pynvml``, and only when the node is not simulated) and
:mod:`gpushare.gpu.simulated` (a YAML node description), so the daemon, the demo and the
tests run the same code on a laptop as on a GPU node. Which one a node gets is chosen in
:func:`gpushare.node.discovery.open_backend`. (The enforcement probe, :mod:`gpushare.probe`,
a separate program run inside a tenant's container, imports ``pynvml`` too.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

#: NVML XID events that the card itself reports; delivered to the health monitor.
XID_DEVICE_LOST = 79
#: How often the NVML backend reads every card to notice one lost or back.
PROBE_SECONDS = 5.0


class GpuError(Exception):
    """The GPUs cannot be read (driver missing, NVML failure, bad simulated node file)."""


#: What NVML puts in an event's GPU-instance / compute-instance ID when it names none.
NO_INSTANCE = 0xFFFFFFFF


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a compute instance inside a GPU instance) of a card in MIG mode."""

    uuid: str  # MIG-..., as NVML returns it
    parent_uuid: str
    profile: str  # as NVIDIA's tools print it: 3g.20gb, 1c.2g.10gb, 1g.10gb+me
    memory_mib: int
    gpu_instance: int
    compute_instance: int
    index: int = 0  # NVML's MIG device index on the parent
    sm_count: int = 0


@dataclass(frozen=True)
class Gpu:
    """What gpushare needs to know about one physical card."""

    uuid: str
    name: str
    memory_mib: int
    index: int
    minor: int
    numa_node: int | None = None
    mig_enabled: bool = False
    pci_bus_id: str = ""
    #: NVML's pending MIG mode differs from the current one: it changes at the next reset.
    mig_pending: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    #: Set when this record is a MIG device sliced like a card (``migSharing``): the
    #: card it lives on. Such a "card" has memory units only, no core units.
    parent_uuid: str = ""
    compute_capability: tuple[int, int] | None = None  # (major, minor), for the labels
    #: What the driver keeps of ``memory_mib`` for itself (NVML's ``nvmlMemory_v2_t``
    #: ``reserved``; about 450 MiB on a T4): no tenant can ever allocate it. 0 where the
    #: driver does not tell (the version 1 call) or a simulated node states none.
    reserved_mib: int = 0
    #: Whether the driver's persistence mode is on (NVML); None: not known (issue 41 item 6).
    persistence_mode: bool | None = None

    @property
    def allocatable_mib(self) -> int:
        """The memory shares are counted from: the total less the driver's reservation."""
        return max(self.memory_mib - self.reserved_mib, 0)


@dataclass(frozen=True)
class GpuEvent:
    """Something NVML told us about one card or MIG device: an XID error, that it left
    or came back, or that its MIG mode or layout no longer is what was discovered."""

    uuid: str
    xid: int | None = None  # None: the card disappeared (gone=True) or came back
    gone: bool = False
    #: Where NVML names them, the GPU and compute instance the XID came from.
    gpu_instance: int | None = None
    compute_instance: int | None = None
    mig_changed: bool = False


class GpuBackend(Protocol):
    """Where the GPUs come from."""

    def discover(self) -> list[Gpu]:
        """All cards on the node, MIG cards included (the caller skips those)."""
        ...

    def watch(self, deliver: Callable[[GpuEvent], None], stop: threading.Event) -> None:
        """Block until ``stop`` is set, calling ``deliver`` for every event seen."""
        ...

    def close(self) -> None: ...


def drifted(served: Gpu, now: Gpu) -> bool:
    """Whether a card's MIG mode or set of MIG devices is no longer what is served (a MIG
    device missing from ``now`` is not drift: it is gone, and may come back)."""
    if (served.mig_enabled, served.mig_pending) != (now.mig_enabled, now.mig_pending):
        return True
    known = {device.uuid for device in served.mig_devices}
    return any(device.uuid not in known for device in now.mig_devices)
