"""The device-plugin gRPC servers: one per resource, each on its own unix socket.

The shared resources (memory and core units) are served here; exclusive devices
(whole cards, MIG instances) by :mod:`gpushare.deviceplugin.exclusive` on the same base.

The servicer only translates: it checks the shape of a request, asks the
:class:`~gpushare.deviceplugin.binding.Binder`, and turns the result or the refusal into the
kubelet's messages or a gRPC status. A request can fail; the server never does.

Every server runs on the kubelet doors' one gRPC kit (:mod:`gpushare.base.kubeletgrpc`):
one asyncio event loop for every server of the process, a ListAndWatch stream a
coroutine on it holding no thread, the unary calls (plain functions: the binder does
blocking work) on a small pool of threads no stream can occupy, one socket helper,
and every call timed into the one :data:`~gpushare.base.kubeletgrpc.CallHook`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import structlog

from gpushare._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushare.base.kubeletgrpc import CallHook, KubeletServer, ServerLoop, board_stream, observed
from gpushare.deviceplugin import socketnames
from gpushare.deviceplugin.binding import Binder, BindingError, Refusal
from gpushare.gpu.health import HealthBoard
from gpushare.share.answers import ContainerEdits
from gpushare.share.devices import Inventory, Resource, format_device_id
from gpushare.share.gputype import CardChoice

log = structlog.get_logger(__name__)

#: The reply message of one request.
Reply = TypeVar("Reply")

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

_STATUS = {
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.INTERNAL: grpc.StatusCode.INTERNAL,
}

#: A ListAndWatch stream is woken by every health change and by its own end; this is
#: only a safety net for a wake-up that went missing.
STREAM_CHECK_SECONDS = 30.0


def answer_to_proto(answer: ContainerEdits) -> api_pb2.ContainerAllocateResponse:
    return api_pb2.ContainerAllocateResponse(
        envs=answer.envs,
        mounts=[
            api_pb2.Mount(
                container_path=m.container_path, host_path=m.host_path, read_only=m.read_only
            )
            for m in answer.mounts
        ],
        annotations=answer.annotations,
        cdi_devices=[api_pb2.CDIDevice(name=name) for name in answer.cdi_devices],
        devices=[
            api_pb2.DeviceSpec(
                container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
            )
            for d in answer.device_specs
        ],
    )


def device_list_message(
    inventory: Inventory, resource: Resource, healthy: Callable[[str], bool]
) -> api_pb2.ListAndWatchResponse:
    """Every unit of ``resource`` on every card, as one ListAndWatch message."""
    devices: list[api_pb2.Device] = []
    for card in inventory.cards.values():
        health = HEALTHY if healthy(card.uuid) else UNHEALTHY
        numa = card.gpu.numa_node
        topology = (
            api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=numa)]) if numa is not None else None
        )
        devices.extend(
            api_pb2.Device(ID=format_device_id(card.uuid, n), health=health, topology=topology)
            for n in range(card.units(resource))
        )
    return api_pb2.ListAndWatchResponse(devices=devices)


class ListingServicer(api_pb2_grpc.DevicePluginServicer):
    """What every resource's server shares: the ListAndWatch stream of whole device
    lists (one per version of ``board``), the stream bookkeeping the kubelet link
    reads, and turning a refusal into a gRPC status. Subclasses build the list and
    answer GetPreferredAllocation and Allocate."""

    def __init__(
        self,
        label: str,
        board: HealthBoard,
        stopping: threading.Event,
        *,
        full_name: str | None = None,
        observe: CallHook | None = None,
    ) -> None:
        self.label = label  # the resource name without prefix, for logs
        self.full_name = full_name or label  # the resource name the kubelet knows
        #: Called after every request (metrics: ``Metrics.observe``).
        self.observe = observe
        self.board = board
        self.stopping = stopping
        self._cache: tuple[int, api_pb2.ListAndWatchResponse] | None = None
        self._cache_lock = threading.Lock()
        self._streams_lock = threading.Lock()
        self.active_streams = 0
        self.streams_changed_at = time.monotonic()
        #: Called when a ListAndWatch stream ends (the kubelet link looks again then).
        self.on_stream_closed: Callable[[], None] | None = None

    # ---------------------------------------------------------------- device list
    def build_device_list(self) -> api_pb2.ListAndWatchResponse:
        raise NotImplementedError

    def device_list(self) -> api_pb2.ListAndWatchResponse:
        """The full device set at the board's current version (built once per version)."""
        with self._cache_lock:
            version = self.board.version
            if self._cache is not None and self._cache[0] == version:
                return self._cache[1]
            response = self.build_device_list()
            self._cache = (version, response)
            return response

    # ---------------------------------------------------------------- RPCs
    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        """A coroutine on the servers' event loop: it holds no thread while it waits.
        A cancelled stream (the kubelet went away, the server stops) ends at its await."""
        self._count_stream(+1)
        log.info("list_and_watch_opened", resource=self.label)
        stream = board_stream(self.board, self.stopping, self.device_list, STREAM_CHECK_SECONDS)
        try:
            async with contextlib.aclosing(stream) as messages:
                async for message in messages:
                    yield message
        finally:
            self._count_stream(-1)
            log.info("list_and_watch_closed", resource=self.label)
            if self.on_stream_closed is not None:
                self.on_stream_closed()

    def _count_stream(self, delta: int) -> None:
        with self._streams_lock:
            self.active_streams += delta
            self.streams_changed_at = time.monotonic()

    def unwatched_for(self) -> float:
        """Seconds since the last ListAndWatch stream closed; 0 while one is open."""
        with self._streams_lock:
            if self.active_streams:
                return 0.0
            return time.monotonic() - self.streams_changed_at

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()

    def _serve(
        self,
        method: str,
        request: object,
        context: grpc.ServicerContext,
        handle: Callable[[], Reply],
    ) -> Reply:
        with observed(self.observe, self.full_name, method) as outcome:
            try:
                return handle()
            except BindingError as exc:
                outcome.result = exc.kind.name.lower()
                log.warning(
                    "request_refused", resource=self.label, method=method, reason=exc.message
                )
                context.abort(_STATUS[exc.kind], exc.message)
            except Exception as exc:  # never let a request take the server down
                outcome.result = "error"
                log.exception("request_failed", resource=self.label, method=method)
                context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc}")
        return None  # unreachable: abort raises


class DevicePluginServicer(ListingServicer):
    """One of the two shared resources (memory or core units)."""

    def __init__(
        self,
        resource: Resource,
        binder: Binder,
        health: HealthBoard,
        stopping: threading.Event,
        observe: CallHook | None = None,
        choice: Callable[[Resource, int], CardChoice | None] | None = None,
        full_name: str | None = None,
    ) -> None:
        super().__init__(resource.value, health, stopping, full_name=full_name, observe=observe)
        self.resource = resource
        self.binder = binder
        self.health = health
        #: The asking pod's card choice (use-gputype annotations), if it can be told.
        self.choice = choice

    def _allowed(self, size: int) -> Callable[[str], bool] | None:
        choice = self.choice(self.resource, size) if self.choice is not None else None
        if choice is None:
            return None
        cards = self.binder.inventory.cards
        return lambda uuid: uuid in cards and choice.allows(cards[uuid].gpu.name, uuid)

    def _check_choice(self, device_ids: Any) -> None:
        """Refuse units on a card the asking pod's annotations exclude."""
        choice = self.choice(self.resource, len(device_ids)) if self.choice is not None else None
        if choice is None or not device_ids:
            return
        card = self.binder.inventory.cards.get(str(device_ids[0]).rpartition("::")[0])
        if card is not None and not choice.allows(card.gpu.name, card.uuid):
            raise BindingError(Refusal.PRECONDITION, choice.why_not(card.gpu.name, card.uuid))

    def build_device_list(self) -> api_pb2.ListAndWatchResponse:
        return device_list_message(self.binder.inventory, self.resource, self.health.is_healthy)

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        def handle() -> api_pb2.PreferredAllocationResponse:
            responses = []
            for container in request.container_requests:
                ids = self.binder.preferred(
                    self.resource,
                    container.available_deviceIDs,
                    container.must_include_deviceIDs,
                    container.allocation_size,
                    allowed=self._allowed(container.allocation_size),
                )
                responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
            return api_pb2.PreferredAllocationResponse(container_responses=responses)

        return self._serve("GetPreferredAllocation", request, context, handle)

    def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocateResponse:
        def handle() -> api_pb2.AllocateResponse:
            if not request.container_requests:
                raise BindingError(Refusal.INVALID, "the request holds no container requests")
            responses = []
            for container in request.container_requests:
                try:
                    self._check_choice(container.devices_ids)
                except BindingError:
                    self.binder.refused()  # the pod is rejected: it pairs with nothing
                    raise
                _uuid, answer = self.binder.allocate(self.resource, container.devices_ids)
                responses.append(answer_to_proto(answer))
            return api_pb2.AllocateResponse(container_responses=responses)

        return self._serve("Allocate", request, context, handle)


class PluginServer:
    """A gRPC server for one resource, bound to ``<kubelet dir>/<socket name>`` (on the
    kit's shared loop: see :mod:`gpushare.base.kubeletgrpc`).

    Every name it serves on is its daemon instance's own (``token``:
    :mod:`gpushare.deviceplugin.socketnames`): first ``<stem>.<token>.sock`` (its
    :attr:`base_path`, e.g. ``gpushare-vcuda-memory.1a2b3c.sock``), then, each time it is
    told to serve on a fresh one (:meth:`restart` with ``fresh``),
    ``<stem>.<token>-<n>.sock``. Two daemons of one node (a rolling update with
    ``maxSurge``) never touch each other's sockets. A kubelet keys each plugin endpoint
    by its socket path, and from 1.37 on refuses a second registration of a path it still
    holds an endpoint for ("device plugin already connected"), a refusal that also drops
    its record of the first client, so that the path stays refused until the kubelet
    restarts (measured on v1.37.2: docs/restarts.md).
    :class:`~gpushare.deviceplugin.registration.KubeletLink` therefore offers one path to
    one kubelet once.
    """

    def __init__(
        self,
        servicer: ListingServicer,
        directory: Path,
        base_name: str,
        token: str,
        loop: ServerLoop | None = None,
    ) -> None:
        self.servicer = servicer
        #: the resource's name without the instance (``gpushare-vcuda-memory.sock``)
        self.base_name = base_name
        self.token = token
        #: this instance's first name for the resource, where it returns when it can
        self.base_path = directory / socketnames.instance_name(base_name, token)
        self.socket_path = self.base_path
        #: socket path -> the kubelet (its socket's identity) it was last offered to
        self.offered: dict[Path, object] = {}
        self._loop = loop
        self._fresh = 0
        self._server = self._server_on(self.socket_path)

    def _server_on(self, path: Path) -> KubeletServer:
        servicer = self.servicer
        return KubeletServer(
            [lambda server: api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server)],
            [path],
            self._loop,
        )

    def start(self) -> None:
        self._server.start()
        log.info("plugin_serving", resource=self.servicer.label, socket=str(self.socket_path))

    def socket_intact(self) -> bool:
        """False when our socket file was removed or replaced (a kubelet restart does this)."""
        return self._server.intact()

    def stop(self, grace: float = 0.5) -> None:
        self._server.stop(grace)

    def restart(self, fresh: bool = False, *, keep_old: bool = False) -> KubeletServer | None:
        """Serve again: on a fresh socket name with ``fresh``, else on the instance's
        first name (:attr:`base_path`). The old server stops first (its streams end, its
        socket goes); with ``keep_old`` and a new path it is returned still serving
        instead, for the caller to stop once the kubelet holds the new endpoint
        (make-before-break)."""
        path = self.base_path
        if fresh:
            self._fresh += 1
            name = socketnames.renewal_name(self.base_name, self.token, self._fresh)
            path = self.base_path.with_name(name)
        old = self._server
        keep = keep_old and path != self.socket_path
        if not keep:
            self.stop(grace=0)
        if path != self.socket_path:
            self.socket_path = path
            self._server = self._server_on(path)
        self.start()
        return old if keep else None
