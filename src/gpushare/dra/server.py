"""The DRA kubelet plugin's gRPC side: registration, DRAPlugin v1 and v1beta1, health.

The kubelet's plugin watcher finds ``<kubelet root>/plugins_registry/<driver>-reg.sock``,
calls ``Registration.GetInfo`` (type ``DRAPlugin``, the service socket
``<kubelet root>/plugins/<driver>/dra.sock``, and the gRPC services offered, the
preferred first) and reports with ``NotifyRegistrationStatus``. Then it calls
``NodePrepareResources`` / ``NodeUnprepareResources`` of the newest DRAPlugin version both
sides know, and opens one ``DRAResourceHealth.NodeWatchResources`` stream.

The servicers only translate between the kubelet's messages and
:class:`~gpushare.dra.claims.ClaimPreparer`: one failing claim is an ``error`` in its own
entry, never a failed call.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
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
from gpushare.dra.claims import ClaimPreparer, ClaimRef
from gpushare.gpu.health import HealthBoard

log = structlog.get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
#: gRPC service names the kubelet matches in GetInfo's supported_versions, preferred first.
SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
#: How often the health stream repeats the full list even without a change (the kubelet
#: marks a device Unknown when it hears nothing of it for HEALTH_TIMEOUT_SECONDS).
HEALTH_RESEND_SECONDS = 30.0
HEALTH_TIMEOUT_SECONDS = 120
WORKERS = 8


def registration_socket(kubelet_root: Path, driver: str) -> Path:
    return kubelet_root / "plugins_registry" / f"{driver}-reg.sock"


def service_socket(kubelet_root: Path, driver: str) -> Path:
    return kubelet_root / "plugins" / driver / "dra.sock"


def _claims(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]


def _deadline(context: grpc.ServicerContext) -> float | None:
    """The kubelet's deadline for this call, on ``time.monotonic()``'s clock."""
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


class _DraServicer:
    """NodePrepareResources and NodeUnprepareResources for one API version's messages."""

    def __init__(self, preparer: ClaimPreparer, pb2: ModuleType, observe: Observer) -> None:
        self.preparer = preparer
        self.pb2 = pb2
        self.observe = observe

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        began = time.perf_counter()
        outcomes = self.preparer.prepare(
            _claims(request), _deadline(context), lambda: not context.is_active()
        )
        response = self.pb2.NodePrepareResourcesResponse()
        for uid, outcome in outcomes.items():
            entry = response.claims[uid]
            if outcome.error:
                entry.error = outcome.error
                continue
            for device in outcome.devices:
                entry.devices.add(
                    request_names=[device.request] if device.request else [],
                    pool_name=device.pool,
                    device_name=device.device,
                    cdi_device_ids=device.cdi_ids,
                )
        failed = any(o.error for o in outcomes.values())
        self.observe("prepare", "error" if failed else "ok", time.perf_counter() - began)
        return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        began = time.perf_counter()
        errors = self.preparer.unprepare(_claims(request), _deadline(context))
        response = self.pb2.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            response.claims[uid].error = error
        failed = any(errors.values())
        self.observe("unprepare", "error" if failed else "ok", time.perf_counter() - began)
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
Observer = Callable[[str, str, float], None]


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

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        seen = self.board.version
        # A kubelet that goes away ends the wait at once (the stream holds a worker thread).
        context.add_callback(self.board.wake)

        def done() -> bool:
            return self.stopping.is_set() or not context.is_active()

        yield self.snapshot()
        while not done():
            version = self.board.wait_for_change(seen, HEALTH_RESEND_SECONDS, give_up=done)
            if self.stopping.is_set() or not context.is_active():
                return
            seen = version
            yield self.snapshot()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _clear_socket(path: Path) -> None:
    """Remove a socket left by an earlier run; anything else there is an error (never
    a file or link to follow)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(f"{path} exists and is not a socket")
    path.unlink()


class DraServer:
    """One gRPC server listening on the service socket and the registration socket."""

    def __init__(
        self,
        *,
        kubelet_root: Path,
        driver: str,
        pool: str,
        preparer: ClaimPreparer,
        devices: DeviceCards,
        board: HealthBoard,
        observe: Observer = lambda method, result, seconds: None,
    ) -> None:
        self.driver = driver
        self.registration_path = registration_socket(kubelet_root, driver)
        self.service_path = service_socket(kubelet_root, driver)
        self.stopping = threading.Event()
        self.registered: bool | None = None  # None: the kubelet has not reported yet
        self.registration_error = ""
        self._server: grpc.Server | None = None
        self._made: dict[Path, tuple[int, int] | None] = {}
        self._board = board
        self._servicers = (
            _V1(preparer, v1, observe),
            _V1beta1(preparer, v1beta1, observe),
            _Registration(driver, self.service_path, self._on_status),
            _Health(pool, devices, board, self.stopping),
        )

    def _on_status(self, registered: bool, error: str) -> None:
        self.registered, self.registration_error = registered, error
        if registered:
            log.info("dra_registered", driver=self.driver)
        else:
            log.error("dra_registration_refused", driver=self.driver, error=error)

    def start(self) -> None:
        for path in (self.service_path, self.registration_path):
            path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
        v1_servicer, v1beta1_servicer, registration, health = self._servicers
        v1_grpc.add_DRAPluginServicer_to_server(v1_servicer, server)
        v1beta1_grpc.add_DRAPluginServicer_to_server(v1beta1_servicer, server)
        reg_grpc.add_RegistrationServicer_to_server(registration, server)
        health_grpc.add_DRAResourceHealthServicer_to_server(health, server)
        # Both sockets are bound under hidden names of this instance (the plugin watcher
        # skips dot files) and renamed into place once the server answers: the kubelet
        # calls GetInfo as soon as it sees the registration socket, and gRPC, which
        # unlinks its socket paths when it shuts down, then unlinks only names that no
        # longer exist, never the sockets of a newer instance (a rolling update).
        tag = f"{os.getpid()}-{id(self):x}"
        hidden = {
            p: p.with_name(f".{p.name}.{tag}") for p in (self.service_path, self.registration_path)
        }
        for temporary in hidden.values():
            _clear_socket(temporary)
            server.add_insecure_port(f"unix://{temporary}")
        server.start()
        for path, temporary in hidden.items():  # the service first: it is called second
            os.chmod(temporary, 0o600)
            os.rename(temporary, path)
        self._server = server
        # What this instance made: stop() removes these files only, never the sockets of a
        # newer instance that took the paths over (a rolling update).
        self._made = {p: _identity(p) for p in (self.registration_path, self.service_path)}
        log.info(
            "dra_serving",
            driver=self.driver,
            registration=str(self.registration_path),
            service=str(self.service_path),
        )

    def stop(self) -> None:
        self.stopping.set()
        self._board.wake()
        if self._server is not None:
            self._server.stop(grace=1.0).wait()
            self._server = None
        for path, made in self._made.items():
            if made is not None and _identity(path) == made:
                with contextlib.suppress(OSError):
                    _clear_socket(path)
        self._made = {}
