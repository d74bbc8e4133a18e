"""Exclusive devices: resources whose every device goes whole to one container.

Whole cards (``<prefix>/gpu``, device ID = the card's UUID) and MIG instances
(``MIG-<uuid>``) are the same kind of resource: a fixed list of devices, each with
its own health, a container asking for ``n`` of them gets ``n`` distinct devices and
is told their IDs (``NVIDIA_VISIBLE_DEVICES=<id>,<id>`` and/or CDI names). The
resource and its ledger are core state (:mod:`gpushare.share.whole`); this module
serves such a resource to the kubelet (:class:`ExclusiveServicer`, on the same base as
the shared resources' servers).
What a device's health is, which devices to prefer and what the answer holds are
given to the servicer as plain callables, so each kind of resource decides those
in its own pure module (``topology.py`` for whole cards).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

import grpc
import structlog

from gpushare._proto.deviceplugin.v1beta1 import api_pb2
from gpushare.base.kubeletgrpc import CallHook
from gpushare.deviceplugin.binding import BindingError, Refusal
from gpushare.deviceplugin.plugin import HEALTHY, UNHEALTHY, ListingServicer, answer_to_proto
from gpushare.gpu.health import HealthBoard, unhealthy
from gpushare.host.grants import GrantHost, HostGrantError
from gpushare.host.grantspecs import exclusive_grant_name
from gpushare.share import answers
from gpushare.share.answers import ContainerEdits, DeviceListing, Enforcement, GrantedDevice
from gpushare.share.devices import InvalidDeviceIds
from gpushare.share.gputype import CardChoice
from gpushare.share.whole import (
    ExclusiveDevice,
    ExclusiveResource,
)

log = structlog.get_logger(__name__)

# --------------------------------------------------------------------------- policies

#: (available, must include, size) -> the devices to offer, best first.
Preference = Callable[[Sequence[ExclusiveDevice], Sequence[ExclusiveDevice], int], list[str]]
#: The devices of one container, in order -> its Allocate answer (from the answer port).
EditsFor = Callable[[Sequence[ExclusiveDevice]], ContainerEdits]


def in_order(
    available: Sequence[ExclusiveDevice], must_include: Sequence[ExclusiveDevice], size: int
) -> list[str]:
    """The default preference: the required devices, then the first available ones."""
    chosen = [d.id for d in must_include]
    chosen += [d.id for d in available if d.id not in chosen]
    return chosen[:size]


def granted(device: ExclusiveDevice, nodes: Sequence[str] = ()) -> GrantedDevice:
    """One exclusive device as the answer port's input (named by its ID: the listing
    maps it to its CDI index name where the node asks for that)."""
    return GrantedDevice(device.id, memory_mib=device.memory_mib, nodes=tuple(nodes))


def whole_card_answer(
    listing: DeviceListing, *, enforcement: Enforcement | None = None
) -> EditsFor:
    """Whole cards' answer: the cards named by ``listing``; with ``enforcement``
    (``exclusiveEnforcement``) the interposer with 100 % limits (see
    :func:`gpushare.share.answers.container_edits`)."""

    def answer(devices: Sequence[ExclusiveDevice]) -> ContainerEdits:
        grant = answers.whole([granted(d) for d in devices], enforcement=enforcement)
        return answers.container_edits(grant, listing)

    return answer


def time_sliced_answer(listing: DeviceListing) -> EditsFor:
    """A time-sliced replica's answer: its card, whole and raw, named by ``listing``; no
    limits (``none``: NVIDIA's ``gpu.shared`` time-slicing)."""

    def answer(devices: Sequence[ExclusiveDevice]) -> ContainerEdits:
        cards = dict.fromkeys(d.parent for d in devices)  # in order, each card once
        grant = answers.whole([GrantedDevice(uuid) for uuid in cards])
        return answers.container_edits(grant, listing)

    return answer


def sealed_by(answer: EditsFor, full_name: str, host: GrantHost) -> EditsFor:
    """``answer``, under a CDI device-list strategy riding on the grant's own CDI spec
    (``host/grants.py`` writes it, named by :func:`exclusive_grant_name`): the kubelet's
    answer then carries no env, so a pod's ``NVIDIA_VISIBLE_DEVICES=all`` or
    ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` is replaced by the runtime with the grant's own
    values (see :func:`gpushare.share.answers.sealed`). As it is otherwise (``envvar``:
    the admission policy and the daemon's check refuse such pods, docs/security.md)."""
    if not host.seals:
        return answer

    def sealed_answer(devices: Sequence[ExclusiveDevice]) -> ContainerEdits:
        name = exclusive_grant_name(full_name, [d.id for d in devices])
        try:
            return host.seal(answer(devices), name)
        except HostGrantError as exc:
            raise BindingError(Refusal.INTERNAL, str(exc)) from None

    return sealed_answer


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
        answer: EditsFor,
        prefer: Preference = in_order,
        on_allocated: Callable[[str, Sequence[ExclusiveDevice]], None] | None = None,
        observe: CallHook | None = None,
        choice: Callable[[int], CardChoice | None] | None = None,
        guard: Callable[[], str | None] | None = None,
        most: int | None = None,
    ) -> None:
        super().__init__(resource.name, board, stopping, full_name=full_name, observe=observe)
        #: The most devices one container may ask (time-sliced replicas: one), or None.
        self.most = most
        #: Why this Allocate must be refused although its devices are free (a container
        #: mixing shared units with these devices), or None.
        self.guard = guard
        #: The asking pod's card choice (use-gputype annotations), if it can be told.
        self.choice = choice
        self.resource = resource
        self.answer = answer
        self.prefer = prefer
        self.on_allocated = on_allocated

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

    def _resolve(self, device_ids: Iterable[str]) -> list[ExclusiveDevice]:
        try:
            return self.resource.resolve(device_ids)
        except InvalidDeviceIds as exc:
            raise BindingError(Refusal.INVALID, str(exc)) from None

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        def handle() -> api_pb2.PreferredAllocationResponse:
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

    def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocateResponse:
        def handle() -> api_pb2.AllocateResponse:
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
                if self.most is not None and len(devices) > self.most:
                    raise BindingError(
                        Refusal.PRECONDITION,
                        f"a container asks {len(devices)} {self.full_name}; it gets "
                        f"{self.most} (the whole card, time-shared with the card's other "
                        f"tenants): ask {self.most}",
                    )
                choice = self.choice(len(devices)) if self.choice is not None else None
                for device in devices:
                    if choice is not None and not choice.allows(device.name, device.parent):
                        raise BindingError(
                            Refusal.PRECONDITION, choice.why_not(device.name, device.parent)
                        )
                    reason = unhealthy(self.board, (device.id,))
                    if reason is not None:
                        raise BindingError(
                            Refusal.PRECONDITION,
                            f"{self.resource.name} device {device.id} cannot be handed out: "
                            f"{reason}",
                        )
                containers.append(devices)
            # Every answer (a grant's CDI spec written under CDI) before anything is
            # recorded: a spec that cannot be written refuses the whole request.
            built = [self.answer(devices) for devices in containers]
            responses = []
            for devices, answer in zip(containers, built, strict=True):
                if self.on_allocated is not None:
                    self.on_allocated(self.full_name, devices)
                responses.append(answer_to_proto(answer))
                log.info(
                    "allocated",
                    resource=self.resource.name,
                    devices=[d.id for d in devices],
                    parents=sorted({d.parent for d in devices}),
                )
            return api_pb2.AllocateResponse(container_responses=responses)

        return self._serve("Allocate", request, context, handle)
