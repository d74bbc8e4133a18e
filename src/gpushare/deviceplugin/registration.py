"""Registration with the kubelet, and the watch that keeps the plugin registered.

The kubelet forgets a plugin whenever it restarts (it deletes every socket in its
directory and creates a new ``kubelet.sock``) and whenever a ListAndWatch stream
ends. :class:`KubeletLink` notices both and registers again.

A second offer to the same kubelet comes on a fresh socket path (see
:meth:`KubeletLink._offer_once`), and how the old server gives way depends on the
kubelet's version (issue 41.8):

* **1.37 and later** (kubernetes#135437) key endpoints by socket path: a registration
  makes the new endpoint the resource's own at once, and the old one's stream ending
  later only removes it. So the new server is started and registered first and the old
  one stopped after (make-before-break): no moment where the kubelet's endpoint is a
  stopped server.
* **1.36 and earlier** keep one client per resource: when the old stream ends, the
  kubelet disconnects whichever client is current, the new one included, and marks the
  resource's devices unhealthy (kubernetes#121994). Overlapping would kill the new
  endpoint, so the old server stops first (break-before-make), as before: a registration's
  moment without a serving endpoint. So does an unknown version (no API server).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import structlog

from gpushare._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushare.base.dirwatch import DirWatch
from gpushare.base.kubeletgrpc import KubeletServer, SocketIdentity, socket_identity
from gpushare.deviceplugin.plugin import PluginServer

log = structlog.get_logger(__name__)

API_VERSION = "v1beta1"
REGISTER_TIMEOUT = 5.0
POLL_SECONDS = 0.1
#: With inotify watching the kubelet's directory, still look this often (a safety net).
WATCHED_CHECK_SECONDS = 10.0
MAX_BACKOFF = 5.0
#: A registered resource whose kubelet stream stays closed this long is registered again.
UNWATCHED_GRACE = 2.0
#: While kubelet.sock is missing, say so at once and then this often.
MISSING_LOG_SECONDS = 60.0


#: The first kubelet minor that keys device-plugin endpoints by socket path.
MAKE_BEFORE_BREAK_FROM = (1, 37)
#: An old server given way to by make-before-break serves calls in flight this long.
OLD_SERVER_GRACE = 2.0


def make_before_break(kubelet_version: str) -> bool:
    """Whether a kubelet of this version (``v1.37.2``, as the Node's
    ``status.nodeInfo.kubeletVersion`` says; "" unknown) lets a renewed endpoint overlap
    the old one. Unknown or unreadable: no."""
    text = kubelet_version.strip().removeprefix("v")
    parts = text.split(".")
    if len(parts) < 2 or not (parts[0].isascii() and parts[0].isdigit()):
        return False
    minor = ""
    for char in parts[1]:
        if not (char.isascii() and char.isdigit()):
            break
        minor += char
    if not minor:
        return False
    return (int(parts[0]), int(minor)) >= MAKE_BEFORE_BREAK_FROM


class RegistrationError(Exception):
    pass


class NotDelivered(RegistrationError):
    """The kubelet's socket refused the connection: the kubelet never saw the request
    (a kubelet.sock bound but not yet listening, or one whose kubelet is gone)."""


class RegistrationAbandoned(RegistrationError):
    """Given up half-way because the kubelet or our socket changed: try again at once."""


def register(
    kubelet_socket: Path,
    endpoint: str,
    resource_name: str,
    abandon: Callable[[], bool] = lambda: False,
) -> None:
    """Register one resource; the plugin must already be serving on ``endpoint``.

    The kubelet dials the plugin back before it answers, which can hang when the
    kubelet restarts again meanwhile; ``abandon`` is checked every poll interval and
    ends the wait as soon as it holds.
    """
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)
        call = stub.Register.future(
            api_pb2.RegisterRequest(
                version=API_VERSION,
                endpoint=endpoint,
                resource_name=resource_name,
                options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True),
            ),
            timeout=REGISTER_TIMEOUT,
        )
        while True:
            try:
                call.result(timeout=POLL_SECONDS)
                return
            except grpc.FutureTimeoutError:
                if abandon():
                    call.cancel()
                    raise RegistrationAbandoned(
                        "the kubelet socket changed while registering"
                    ) from None
            except grpc.RpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
                if exc.code() == grpc.StatusCode.UNAVAILABLE and "connect" in str(exc.details()):
                    raise NotDelivered(why) from None
                raise RegistrationError(why) from None


class KubeletLink:
    """Keeps every plugin server serving and registered, for as long as it runs.

    It sleeps until something may have changed: an entry of the kubelet's directory
    (inotify: ``kubelet.sock`` re-created, one of our sockets removed), a ListAndWatch
    stream closing, or a deadline of its own (a backoff, the grace given to a closed
    stream). Without inotify it looks every :data:`POLL_SECONDS`.
    """

    def __init__(
        self,
        kubelet_socket: Path,
        servers: Sequence[tuple[PluginServer, str]],
        kubelet_version: Callable[[], str] = lambda: "",
    ) -> None:
        self.kubelet_socket = kubelet_socket
        self.servers = list(servers)  # (server, resource name)
        #: the kubelet's version ("v1.37.2"; "" unknown): how a renewal gives way
        self.kubelet_version = kubelet_version
        self.registered = threading.Event()
        self.registrations = 0
        #: re-registrations that came from the kubelet not watching (the grace path),
        #: not from its socket changing
        self.unwatched_retries = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered_with: SocketIdentity | None = None
        #: the kubelet.sock last registered with (kept when it goes missing)
        self._last_kubelet: SocketIdentity | None = None
        #: called when a registration follows a new kubelet.sock (a kubelet restart)
        self.on_restart: list[Callable[[], None]] = []
        self._registered_at = time.monotonic()
        self._unwatched_grace = UNWATCHED_GRACE
        self._unregistered_since: float | None = time.monotonic()
        self._missing_since: float | None = None  # kubelet.sock absent since (monotonic)
        self._missing_logged_at = 0.0
        self._watch = DirWatch(kubelet_socket.parent, POLL_SECONDS)
        for server, _name in self.servers:
            server.servicer.on_stream_closed = self._watch.wake

    def alive(self) -> bool:
        """True while the watch thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def registered_with_current(self) -> bool:
        """Registered, with the kubelet whose ``kubelet.sock`` is in place now (not one
        whose socket was replaced since: a registration with it is still to come)."""
        kubelet = socket_identity(self.kubelet_socket)
        return self.registered.is_set() and kubelet is not None and kubelet == self._registered_with

    def unregistered_seconds(self) -> float:
        """Seconds since the registration was lost (or since start); 0 while registered."""
        since = self._unregistered_since
        return 0.0 if since is None else time.monotonic() - since

    def _lost(self) -> None:
        self.registered.clear()
        if self._unregistered_since is None:
            self._unregistered_since = time.monotonic()

    def start(self) -> None:
        thread = threading.Thread(target=self._run, name="kubelet-link", daemon=True)
        thread.start()
        self._thread = thread  # only once it runs: stop() joins it

    def stop(self) -> None:
        self._stop.set()
        self._watch.wake()
        if self._thread is not None:
            self._thread.join()
        self._watch.close()

    def _run(self) -> None:
        backoff = POLL_SECONDS
        waiting_logged = False
        while not self._stop.is_set():
            try:
                self._check_once()
                backoff = POLL_SECONDS
                waiting_logged = False
            except RegistrationAbandoned as exc:
                log.info("registration_abandoned", reason=str(exc))
                continue
            except RegistrationError as exc:
                if not waiting_logged:
                    log.warning("registration_failed", error=str(exc), retry_seconds=backoff)
                    waiting_logged = True
                self._wait_unless_kubelet_changes(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            except Exception:  # e.g. a plugin socket that cannot be re-created: keep trying
                if not waiting_logged:
                    log.exception("kubelet_link_error", retry_seconds=backoff)
                    waiting_logged = True
                self._lost()
                self._registered_with = None
                self._wait_unless_kubelet_changes(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            self._watch.wait(self._next_check())

    def _unwatched_for(self, server: PluginServer) -> float:
        """Seconds the kubelet has left ``server`` unwatched since we last registered.

        A stream that closed during a kubelet outage counts from the registration
        that followed it, so the kubelet gets the full grace to open a new one.
        """
        since_registered = time.monotonic() - self._registered_at
        return min(server.servicer.unwatched_for(), since_registered)

    def _report_missing(self) -> None:
        """Log a missing kubelet.sock once, then every :data:`MISSING_LOG_SECONDS`."""
        now = time.monotonic()
        if self._missing_since is None:
            self._missing_since = now
            self._missing_logged_at = now - MISSING_LOG_SECONDS
        if now - self._missing_logged_at >= MISSING_LOG_SECONDS:
            self._missing_logged_at = now
            log.warning(
                "kubelet_socket_missing",
                socket=str(self.kubelet_socket),
                missing_seconds=round(now - self._missing_since),
                hint="is the kubelet running, and --kubelet-dir its device-plugins directory?",
            )

    def _next_check(self) -> float:
        """Seconds until a look is due even if nothing wakes the link."""
        wait = WATCHED_CHECK_SECONDS
        if self._registered_with is not None:
            for server, _name in self.servers:
                unwatched = self._unwatched_for(server)
                if unwatched > 0.0:  # its stream closed: look again when the grace ends
                    wait = min(wait, max(0.0, self._unwatched_grace - unwatched) + 0.01)
        return wait

    def _wait_unless_kubelet_changes(self, seconds: float) -> None:
        """Back off, but retry at once when a new kubelet socket appears."""
        failed_with = socket_identity(self.kubelet_socket)
        deadline = time.monotonic() + seconds
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or socket_identity(self.kubelet_socket) != failed_with:
                return
            self._watch.wait(left)

    def _changed_since(self, kubelet: SocketIdentity | None) -> Callable[[], bool]:
        def changed() -> bool:
            return (
                self._stop.is_set()
                or socket_identity(self.kubelet_socket) != kubelet
                or not all(server.socket_intact() for server, _ in self.servers)
            )

        return changed

    @staticmethod
    def _offer_once(
        server: PluginServer, kubelet: SocketIdentity, overlap: bool
    ) -> KubeletServer | None:
        """Never offer one socket path to one kubelet twice. A kubelet may still hold an
        endpoint of a path it was offered (an attempt that timed out on our side can have
        connected on its side), and from 1.37 on it refuses that path again for as long
        as it runs ("device plugin already connected"): serve on a fresh name first.
        With ``overlap`` (make-before-break) the old server is returned still serving,
        to be stopped once the new path is registered."""
        server.offered = {p: k for p, k in server.offered.items() if k == kubelet}
        base_free = server.base_path not in server.offered
        old_server = None
        if server.socket_path in server.offered or (
            base_free and server.socket_path != server.base_path
        ):
            old = server.socket_path.name
            # back to the instance's first name where it can
            old_server = server.restart(fresh=not base_free, keep_old=overlap)
            log.info(
                "plugin_socket_renewed",
                resource=server.servicer.label,
                old=old,
                endpoint=server.socket_path.name,
                reason="this kubelet was offered the old socket already"
                if old in {p.name for p in server.offered}
                else "a kubelet not offered the base name yet",
                old_stops="after the registration"
                if old_server is not None
                else "before the registration",
            )
        server.offered[server.socket_path] = kubelet
        return old_server

    @staticmethod
    def _give_way(old: KubeletServer) -> None:
        """Stop a server made way for (make-before-break), in the background: calls in
        flight on it get :data:`OLD_SERVER_GRACE` to end, and the link goes on meanwhile."""
        threading.Thread(
            target=old.stop, args=(OLD_SERVER_GRACE,), name="plugin-old-server", daemon=True
        ).start()

    def _check_once(self) -> None:
        resurrected = False
        for server, _name in self.servers:
            if not server.socket_intact():
                log.warning("plugin_socket_lost", socket=str(server.socket_path))
                server.restart()
                resurrected = True
        kubelet = socket_identity(self.kubelet_socket)
        if kubelet is None:
            if self._registered_with is not None:
                log.warning("kubelet_socket_gone", socket=str(self.kubelet_socket))
                self._registered_with = None
                self._lost()
            self._report_missing()
            return
        self._missing_since = None
        unwatched = any(
            self._unwatched_for(server) > self._unwatched_grace for server, _ in self.servers
        )
        if kubelet == self._registered_with and not resurrected and not unwatched:
            return
        if unwatched and kubelet == self._registered_with:
            log.warning("kubelet_stopped_watching", retry_after_seconds=self._unwatched_grace)
            self.unwatched_retries += 1
            self._unwatched_grace = min(self._unwatched_grace * 2, 60.0)
        else:
            self._unwatched_grace = UNWATCHED_GRACE
        self._lost()
        if self.registrations and kubelet != self._last_kubelet:
            # a new kubelet.sock after a registration: the kubelet restarted
            log.info("kubelet_restarted", socket=str(self.kubelet_socket))
            for hook in list(self.on_restart):
                hook()
        self._last_kubelet = kubelet
        overlap = make_before_break(self.kubelet_version())
        for server, name in self.servers:
            old = self._offer_once(server, kubelet, overlap)
            try:
                register(
                    self.kubelet_socket,
                    server.socket_path.name,
                    name,
                    self._changed_since(kubelet),
                )
            except NotDelivered:
                server.offered.pop(server.socket_path, None)  # the kubelet never saw it
                raise
            finally:
                if old is not None:
                    self._give_way(old)
            log.info("registered", resource=name, endpoint=server.socket_path.name)
        self._registered_with = kubelet
        self._registered_at = time.monotonic()
        self.registrations += 1
        self._unregistered_since = None
        self.registered.set()
