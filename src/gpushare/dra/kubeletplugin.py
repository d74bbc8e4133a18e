"""The DRA kubelet plugin's gRPC side: registration, DRAPlugin v1 and v1beta1, health.

The kubelet's plugin watcher finds ``<kubelet root>/plugins_registry/<driver>-reg.sock``,
calls ``Registration.GetInfo`` (type ``DRAPlugin``, the service socket
``<kubelet root>/plugins/<driver>/dra.sock``, and the gRPC services offered, the
preferred first) and reports with ``NotifyRegistrationStatus``. Then it calls
``NodePrepareResources`` / ``NodeUnprepareResources`` of the newest DRAPlugin version both
sides know, and opens one ``DRAResourceHealth.NodeWatchResources`` stream.

The servicers only translate between the kubelet's messages and
:class:`~gpushare.dra.claims.ClaimPreparer`: one failing claim is an ``error`` in its own
entry, never a failed call. They run on the kubelet doors' one gRPC kit
(:mod:`gpushare.base.kubeletgrpc`), as the device plugin's do: the health stream is a
coroutine on the shared loop holding no thread, prepare and unprepare run on the kit's
pool, every call is timed into the one :data:`~gpushare.base.kubeletgrpc.CallHook`
(resource: the driver's name; a call with a failed claim counts as ``error``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import structlog

from gpushare._proto.dra.v1 import api_pb2 as v1
from gpushare._proto.dra.v1 import api_pb2_grpc as v1_grpc
from gpushare._proto.dra.v1beta1 import api_pb2 as v1beta1
from gpushare._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpushare._proto.drahealth.v1alpha1 import api_pb2 as health_pb2
from gpushare._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from gpushare._proto.pluginregistration.v1 import api_pb2 as reg_pb2
from gpushare._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gpushare.base.kubeletgrpc import CallHook, KubeletServer, board_stream, observed
from gpushare.dra.claimread import ClaimRef
from gpushare.dra.claims import ClaimPreparer
from gpushare.gpu.health import HealthBoard

log = structlog.get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
#: gRPC service names the kubelet matches in GetInfo's supported_versions, preferred first.
SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
#: How often the health stream repeats the full list even without a change (the kubelet
#: marks a device Unknown when it hears nothing of it for HEALTH_TIMEOUT_SECONDS).
HEALTH_RESEND_SECONDS = 30.0
HEALTH_TIMEOUT_SECONDS = 120


def registration_socket(kubelet_root: Path, driver: str) -> Path:
    return kubelet_root / "plugins_registry" / f"{driver}-reg.sock"


def service_socket(kubelet_root: Path, driver: str) -> Path:
    return kubelet_root / "plugins" / driver / "dra.sock"


def _claims(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]


def _call_state(context: Any) -> tuple[float | None, Callable[[], bool]]:
    """The kubelet's deadline for this call (on ``time.monotonic()``'s clock; None: no
    deadline) and whether the call has ended (cancelled, or the kubelet went away):
    what is not started past either is not done."""
    left = context.time_remaining()
    deadline = None if left is None else time.monotonic() + left
    is_active = getattr(context, "is_active", None)  # not on the aio kit's sync contexts
    if is_active is None:
        return deadline, lambda: False
    return deadline, lambda: not is_active()


class _DraServicer:
    """NodePrepareResources and NodeUnprepareResources for one API version's messages."""

    def __init__(
        self, preparer: ClaimPreparer, pb2: ModuleType, driver: str, observe: CallHook | None
    ) -> None:
        self.preparer = preparer
        self.pb2 = pb2
        self.driver = driver
        self.observe = observe

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        with observed(self.observe, self.driver, "NodePrepareResources") as outcome:
            deadline, ended = _call_state(context)
            outcomes = self.preparer.prepare(_claims(request), deadline, ended)
            response = self.pb2.NodePrepareResourcesResponse()
            for uid, prepared in outcomes.items():
                entry = response.claims[uid]
                if prepared.error:
                    entry.error = prepared.error
                    outcome.result = "error"
                    continue
                for device in prepared.devices:
                    entry.devices.add(
                        request_names=[device.request] if device.request else [],
                        pool_name=device.pool,
                        device_name=device.device,
                        cdi_device_ids=device.cdi_ids,
                    )
            return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        with observed(self.observe, self.driver, "NodeUnprepareResources") as outcome:
            errors = self.preparer.unprepare(_claims(request), _call_state(context)[0])
            response = self.pb2.NodeUnprepareResourcesResponse()
            for uid, error in errors.items():
                response.claims[uid].error = error
            if any(errors.values()):
                outcome.result = "error"
            return response


class _V1(_DraServicer, v1_grpc.DRAPluginServicer):
    pass


class _V1beta1(_DraServicer, v1beta1_grpc.DRAPluginServicer):
    pass


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: Path, on_status: Callable[[bool, str], None]):
        self.driver = driver
        self.endpoint = endpoint
        self.on_status = on_status

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return reg_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver,
            endpoint=str(self.endpoint),
            supported_versions=list(SUPPORTED_SERVICES),
        )

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.on_status(request.plugin_registered, request.error)
        return reg_pb2.RegistrationStatusResponse()


#: (device name, its health keys: the card's UUID, and a MIG device's own) of every
#: device published, for the health stream.
DeviceCards = Callable[[], Sequence[tuple[str, Sequence[str]]]]


class _Health(health_grpc.DRAResourceHealthServicer):
    def __init__(
        self, pool: str, devices: DeviceCards, board: HealthBoard, stopping: threading.Event
    ) -> None:
        self.pool = pool
        self.devices = devices
        self.board = board
        self.stopping = stopping

    def snapshot(self) -> Any:
        now = int(time.time())
        response = health_pb2.NodeWatchResourcesResponse()
        for name, keys in self.devices():
            sick = [key for key in keys if not self.board.is_healthy(key)]
            response.devices.add(
                device=health_pb2.DeviceIdentifier(pool_name=self.pool, device_name=name),
                health=health_pb2.UNHEALTHY if sick else health_pb2.HEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
                message=self.board.reason(sick[0])[:1024] if sick else "",
            )
        return response

    async def NodeWatchResources(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        """A coroutine on the kit's loop: it holds no thread while it waits. The full
        list goes out at once, after every health change and every
        :data:`HEALTH_RESEND_SECONDS` without one; a cancelled stream (the kubelet went
        away, the server stops) ends at its await."""
        stream = board_stream(
            self.board,
            self.stopping,
            self.snapshot,
            HEALTH_RESEND_SECONDS,
            resend_when_quiet=True,  # nothing changed: the full list again
        )
        async with contextlib.aclosing(stream) as messages:
            async for message in messages:
                yield message


class DraServer:
    """One gRPC server (the kit's :class:`~gpushare.base.kubeletgrpc.KubeletServer`)
    listening on the service socket and the registration socket."""

    def __init__(
        self,
        *,
        kubelet_root: Path,
        driver: str,
        pool: str,
        preparer: ClaimPreparer,
        devices: DeviceCards,
        board: HealthBoard,
        observe: CallHook | None = None,
    ) -> None:
        self.driver = driver
        self.registration_path = registration_socket(kubelet_root, driver)
        self.service_path = service_socket(kubelet_root, driver)
        self.stopping = threading.Event()
        self.registered: bool | None = None  # None: the kubelet has not reported yet
        self.registration_error = ""
        #: called after each registration the kubelet reports as accepted (a kubelet
        #: restart registers the plugin again)
        self.on_registered: list[Callable[[], None]] = []
        self._board = board
        v1_servicer = _V1(preparer, v1, driver, observe)
        v1beta1_servicer = _V1beta1(preparer, v1beta1, driver, observe)
        registration = _Registration(driver, self.service_path, self._on_status)
        health = _Health(pool, devices, board, self.stopping)
        # The service socket is published first: the kubelet calls GetInfo as soon as it
        # sees the registration socket, and the service second.
        self._server = KubeletServer(
            [
                lambda server: v1_grpc.add_DRAPluginServicer_to_server(v1_servicer, server),
                lambda server: v1beta1_grpc.add_DRAPluginServicer_to_server(
                    v1beta1_servicer, server
                ),
                lambda server: reg_grpc.add_RegistrationServicer_to_server(registration, server),
                lambda server: health_grpc.add_DRAResourceHealthServicer_to_server(health, server),
            ],
            [self.service_path, self.registration_path],
        )

    def _on_status(self, registered: bool, error: str) -> None:
        self.registered, self.registration_error = registered, error
        if registered:
            log.info("dra_registered", driver=self.driver)
            for listener in list(self.on_registered):
                listener()
        else:
            log.error("dra_registration_refused", driver=self.driver, error=error)

    def start(self) -> None:
        self._server.start()
        log.info(
            "dra_serving",
            driver=self.driver,
            registration=str(self.registration_path),
            service=str(self.service_path),
        )

    def stop(self) -> None:
        self.stopping.set()
        self._board.wake()
        self._server.stop(grace=1.0)
