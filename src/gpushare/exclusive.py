"""Exclusive devices: resources whose every device goes whole to one container.

Whole cards (``<prefix>/gpu``, device ID = the card's UUID) and MIG instances
(``MIG-<uuid>``) are the same kind of resource: a fixed list of devices, each with
its own health, a container asking for ``n`` of them gets ``n`` distinct devices and
is told their IDs (``NVIDIA_VISIBLE_DEVICES=<id>,<id>`` and/or CDI names). This
module describes such a resource (:class:`ExclusiveResource`), keeps which devices
are held (:class:`ExclusiveLedger`) and serves it to the kubelet
(:class:`ExclusiveServicer`, on the same base as the shared resources' servers).
What a device's health is, which devices to prefer and what the answer holds are
given to the servicer as plain callables, so each kind of resource decides those
in its own pure module (``topology.py`` for whole cards).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from gpushare._proto.deviceplugin.v1beta1 import api_pb2
from gpushare.answers import (
    Answer,
    DeviceListing,
    Enforcement,
    build_exclusive_answer,
    with_device_list,
)
from gpushare.binding import BindingError, Refusal
from gpushare.devices import MAX_DEVICE_ID_LENGTH, InvalidDeviceIds
from gpushare.gpus import Gpu
from gpushare.gputype import CardChoice
from gpushare.health import HealthBoard
from gpushare.plugin import HEALTHY, UNHEALTHY, ListingServicer, answer_to_proto

log = structlog.get_logger(__name__)

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


# --------------------------------------------------------------------------- policies

#: (available, must include, size) -> the devices to offer, best first.
Preference = Callable[[Sequence[ExclusiveDevice], Sequence[ExclusiveDevice], int], list[str]]
#: The devices of one container, in order -> its Allocate answer.
AnswerBuilder = Callable[[Sequence[ExclusiveDevice]], Answer]


def in_order(
    available: Sequence[ExclusiveDevice], must_include: Sequence[ExclusiveDevice], size: int
) -> list[str]:
    """The default preference: the required devices, then the first available ones."""
    chosen = [d.id for d in must_include]
    chosen += [d.id for d in available if d.id not in chosen]
    return chosen[:size]


def answer_builder(
    listing: DeviceListing,
    *,
    enforcement: Enforcement | None = None,
    cdi_by_index: bool = False,
) -> AnswerBuilder:
    """The answer of an exclusive resource: its devices named by ``listing``; with
    ``enforcement``, the interposer with 100 % limits (see :func:`build_exclusive_answer`)."""

    def build(devices: Sequence[ExclusiveDevice]) -> Answer:
        ids = [d.id for d in devices]
        answer = build_exclusive_answer(
            ids, enforcement=enforcement, memory_mib=[d.memory_mib for d in devices]
        )
        cdi_ids = [d.cdi_id or d.id for d in devices] if cdi_by_index else None
        return with_device_list(answer, ids, listing, cdi_ids)

    return build


# --------------------------------------------------------------------------- the server


class ExclusiveServicer(ListingServicer):
    """The device-plugin service of one exclusive resource.

    ``board`` holds each device's availability by device ID (a device is offered
    ``Healthy`` only when its card is healthy and not taken by another kind of use;
    the daemon keeps it so). Allocate refuses a device the board calls unavailable:
    a kubelet acting on an older device list cannot hand it out.
    """

    def __init__(
        self,
        resource: ExclusiveResource,
        full_name: str,
        board: HealthBoard,
        stopping: threading.Event,
        *,
        answer: AnswerBuilder,
        prefer: Preference = in_order,
        on_allocated: Callable[[str, Sequence[ExclusiveDevice]], None] | None = None,
        observe: Callable[[str, str, str, float], None] | None = None,
        choice: Callable[[int], CardChoice | None] | None = None,
        guard: Callable[[], str | None] | None = None,
    ) -> None:
        super().__init__(resource.name, board, stopping)
        #: Why this Allocate must be refused although its devices are free (a container
        #: mixing shared units with these devices), or None.
        self.guard = guard
        #: The asking pod's card choice (use-gputype annotations), if it can be told.
        self.choice = choice
        self.resource = resource
        self.full_name = full_name
        self.answer = answer
        self.prefer = prefer
        self.on_allocated = on_allocated
        self.observe = observe

    def build_device_list(self) -> api_pb2.ListAndWatchResponse:
        devices = []
        for device in self.resource.devices.values():
            numa = device.numa_node
            devices.append(
                api_pb2.Device(
                    ID=device.id,
                    health=HEALTHY if self.board.is_healthy(device.id) else UNHEALTHY,
                    topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=numa)])
                    if numa is not None
                    else None,
                )
            )
        return api_pb2.ListAndWatchResponse(devices=devices)

    def observed(self, method: str, result: str, seconds: float) -> None:
        if self.observe is not None:
            self.observe(self.full_name, method, result, seconds)

    def _resolve(self, device_ids: Iterable[str]) -> list[ExclusiveDevice]:
        try:
            return self.resource.resolve(device_ids)
        except InvalidDeviceIds as exc:
            raise BindingError(Refusal.INVALID, str(exc)) from None

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        def handle() -> Any:
            responses = []
            for container in request.container_requests:
                available = self._resolve(container.available_deviceIDs)
                required = self._resolve(container.must_include_deviceIDs)
                size = container.allocation_size
                if size <= 0 or size > len(available):
                    raise BindingError(
                        Refusal.INVALID,
                        f"allocation_size {size} is not between 1 and the {len(available)} "
                        "available devices",
                    )
                if not {d.id for d in required} <= {d.id for d in available}:
                    raise BindingError(
                        Refusal.INVALID, "must_include_deviceIDs are not all in available_deviceIDs"
                    )
                # The kubelet's offer can predate our last device list (a card just
                # taken the other way): prefer what the board says is free now.
                usable = [d for d in available if self.board.is_healthy(d.id)]
                if len(usable) >= size and set(required) <= set(usable):
                    available = usable
                choice = self.choice(size) if self.choice is not None else None
                if choice is not None:
                    allowed = [d for d in available if choice.allows(d.name, d.parent)]
                    if len(allowed) >= size and set(required) <= set(allowed):
                        available = allowed
                offered = {d.id for d in available}
                ids = [i for i in self.prefer(available, required, size) if i in offered][:size]
                responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
            return api_pb2.PreferredAllocationResponse(container_responses=responses)

        return self._serve("GetPreferredAllocation", request, context, handle)

    def Allocate(self, request: Any, context: Any) -> Any:
        def handle() -> Any:
            if not request.container_requests:
                raise BindingError(Refusal.INVALID, "the request holds no container requests")
            refusal = self.guard() if self.guard is not None else None
            if refusal is not None:
                raise BindingError(Refusal.PRECONDITION, refusal)
            # Check every container first: one refusal must leave nothing recorded.
            containers = []
            for container in request.container_requests:
                devices = self._resolve(container.devices_ids)
                if not devices:
                    raise BindingError(Refusal.INVALID, "the request names no devices")
                choice = self.choice(len(devices)) if self.choice is not None else None
                for device in devices:
                    if choice is not None and not choice.allows(device.name, device.parent):
                        raise BindingError(
                            Refusal.PRECONDITION, choice.why_not(device.name, device.parent)
                        )
                    if not self.board.is_healthy(device.id):
                        reason = self.board.reason(device.id) or "unhealthy"
                        raise BindingError(
                            Refusal.PRECONDITION,
                            f"{self.resource.name} device {device.id} cannot be handed out: "
                            f"{reason}",
                        )
                containers.append(devices)
            responses = []
            for devices in containers:
                if self.on_allocated is not None:
                    self.on_allocated(self.full_name, devices)
                responses.append(answer_to_proto(self.answer(devices)))
                log.info(
                    "allocated",
                    resource=self.resource.name,
                    devices=[d.id for d in devices],
                    parents=sorted({d.parent for d in devices}),
                )
            return api_pb2.AllocateResponse(container_responses=responses)

        return self._serve("Allocate", request, context, handle)
