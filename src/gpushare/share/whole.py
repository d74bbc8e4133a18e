"""Exclusive devices as core state: resources whose every device goes whole to one container.

Whole cards (``<prefix>/gpu``, device ID = the card's UUID) and MIG instances
(``MIG-<uuid>``) are the same kind of resource: a fixed list of devices, each with its own
health; a container asking for ``n`` of them gets ``n`` distinct devices. This module
describes such a resource (:class:`ExclusiveResource`) and keeps which devices are held
(:class:`ExclusiveLedger`); the shared/whole exclusion (:mod:`gpushare.share.exclusion`)
reads both, and a front door serves them (the device plugin's ``ExclusiveServicer``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpushare.gpu.gpus import Gpu
from gpushare.share.devices import MAX_DEVICE_ID_LENGTH, InvalidDeviceIds

#: How long an Allocate is remembered on top of a PodResources snapshot taken before it.
RECENT_ALLOCATION_SECONDS = 30.0

#: The resource name of whole cards, after the prefix.
WHOLE_CARD_RESOURCE = "gpu"


@dataclass(frozen=True)
class ExclusiveDevice:
    """One device of an exclusive resource, as plain data."""

    id: str  # the kubelet's device ID and NVIDIA_VISIBLE_DEVICES entry: GPU-... or MIG-...
    parent: str  # UUID of the physical card it lives on (== id for a whole card)
    name: str  # model ("NVIDIA A100-PCIE-40GB") or MIG profile, for logs and type choices
    index: int  # position: devices are listed and answered in this order
    numa_node: int | None = None
    memory_mib: int = 0  # for exclusiveEnforcement's 100 % memory limit
    cdi_id: str = ""  # its CDI device under the "index" name strategy ("0", "0:1")


class ExclusiveResource:
    """A resource of exclusive devices: its name, its devices in a stable order."""

    def __init__(self, name: str, devices: Iterable[ExclusiveDevice]) -> None:
        self.name = name
        self.devices: dict[str, ExclusiveDevice] = {}
        for device in sorted(devices, key=lambda d: (d.index, d.id)):
            if device.id in self.devices:
                raise ValueError(f"device {device.id} appears twice in {name}")
            if not device.id or len(device.id) > MAX_DEVICE_ID_LENGTH:
                raise ValueError(f"device ID {device.id!r} is empty or over 63 characters")
            self.devices[device.id] = device

    def __len__(self) -> int:
        return len(self.devices)

    def name_with(self, prefix: str) -> str:
        return f"{prefix}/{self.name}"

    @property
    def socket_name(self) -> str:
        return f"gpushare-{self.name}.sock"

    def resolve(self, device_ids: Iterable[str]) -> list[ExclusiveDevice]:
        """The devices named, in the resource's order; raises :class:`InvalidDeviceIds`
        for an ID that is not one of them or appears twice."""
        found: dict[str, ExclusiveDevice] = {}
        for device_id in device_ids:
            device = self.devices.get(device_id)
            if device is None:
                raise InvalidDeviceIds(f"{str(device_id)[:80]!r} is not a {self.name} device")
            if device_id in found:
                raise InvalidDeviceIds(f"{device_id!r} is listed twice")
            found[device_id] = device
        return sorted(found.values(), key=lambda d: (d.index, d.id))


def whole_cards(gpus: Iterable[Gpu], name: str = WHOLE_CARD_RESOURCE) -> ExclusiveResource:
    """One device per card, ID = its UUID."""
    return ExclusiveResource(
        name,
        (
            ExclusiveDevice(
                id=gpu.uuid,
                parent=gpu.uuid,
                name=gpu.name,
                index=gpu.index,
                numa_node=gpu.numa_node,
                memory_mib=gpu.memory_mib,
                cdi_id=str(gpu.index),
            )
            for gpu in gpus
        ),
    )


# --------------------------------------------------------------------------- who holds what


class ExclusiveLedger:
    """Which exclusive devices are held: the kubelet's records (PodResources) plus the
    Allocates answered since the last snapshot was taken. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, set[str]] = {}  # full resource name -> device IDs
        self._recent: list[tuple[float, str, tuple[str, ...]]] = []

    def record(self, resource: str, device_ids: Iterable[str]) -> None:
        ids = tuple(device_ids)
        with self._lock:
            self._held.setdefault(resource, set()).update(ids)
            self._recent.append((self._clock(), resource, ids))

    def replace(self, held: Mapping[str, Iterable[str]], taken_at: float) -> None:
        """Adopt a snapshot taken at ``taken_at``; Allocates answered after it stay."""
        with self._lock:
            fresh = {resource: set(ids) for resource, ids in held.items()}
            horizon = self._clock() - RECENT_ALLOCATION_SECONDS
            self._recent = [entry for entry in self._recent if entry[0] >= horizon]
            for at, resource, ids in self._recent:
                if at >= taken_at:
                    fresh.setdefault(resource, set()).update(ids)
            self._held = fresh

    def held(self, resource: str | None = None) -> set[str]:
        """Device IDs held, of one resource (full name) or of all."""
        with self._lock:
            if resource is not None:
                return set(self._held.get(resource, ()))
            return {d for ids in self._held.values() for d in ids}


# --------------------------------------------------------------------------- time slicing

#: The resource name of time-sliced replicas, after the prefix (NVIDIA's ``gpu.shared``).
TIME_SLICED_RESOURCE = "gpu.shared"
#: Between a card's UUID and the replica's number in a replica's device ID (NVIDIA's).
REPLICA_SEPARATOR = "::"


def time_sliced(
    gpus: Iterable[Gpu], replicas: Mapping[str, int], name: str = TIME_SLICED_RESOURCE
) -> ExclusiveResource:
    """``replicas[uuid]`` devices per card, ID ``<uuid>::<n>``: each container asking one
    gets the whole card, time-shared with the others (no limits)."""
    return ExclusiveResource(
        name,
        (
            ExclusiveDevice(
                id=f"{gpu.uuid}{REPLICA_SEPARATOR}{n}",
                parent=gpu.uuid,
                name=gpu.name,
                index=gpu.index,
                numa_node=gpu.numa_node,
                memory_mib=gpu.memory_mib,
                cdi_id=str(gpu.index),
            )
            for gpu in gpus
            for n in range(replicas[gpu.uuid])
        ),
    )


def spread_replicas(
    available: Sequence[ExclusiveDevice], must_include: Sequence[ExclusiveDevice], size: int
) -> list[str]:
    """Time-sliced replicas to prefer: the required ones, then one of the card with the
    most free replicas (the fewest tenants), the card's lowest replica first. Pure."""
    chosen = [d.id for d in must_include]
    free: dict[str, int] = {}
    for device in available:
        free[device.parent] = free.get(device.parent, 0) + 1
    rest = sorted(
        (d for d in available if d.id not in chosen),
        key=lambda d: (-free[d.parent], d.index, _replica_number(d.id)),
    )
    return (chosen + [d.id for d in rest])[:size]


def _replica_number(device_id: str) -> int:
    tail = device_id.rpartition(REPLICA_SEPARATOR)[2]
    return int(tail) if tail.isdigit() else 0
