"""The one gRPC kit of both kubelet doors (device plugin and DRA driver).

* **One server model.** Every gRPC server of the process runs on one asyncio event loop
  (``grpc.aio``), in one thread (:class:`ServerLoop`). A stream (the device plugin's
  ListAndWatch, the DRA health stream) is a coroutine on the loop, waiting for a change
  without a thread; the unary calls (plain functions: the doors do blocking work) run on
  a small pool of :data:`UNARY_WORKERS` threads that no stream can occupy. grpcio's sync
  server instead keeps a thread per server polling its completion queue ten times a
  second and runs each stream on a worker of its pool, so that a few extra streams took
  every worker and the unary calls waited for a deadline.
* **One socket helper** (:class:`UnixSocket`). A socket is bound under a hidden name of
  this instance (the kubelet's plugin watcher skips dot files) and renamed into place,
  private (0600), once the server answers: a watcher that sees it can call it at once,
  and gRPC, which unlinks its socket paths when it shuts down, then unlinks only names
  that no longer exist, never the socket of a newer instance (a rolling update). Only a
  socket is ever removed (never a file or link to follow), and only the one this
  instance made.
* **One hook signature** (:data:`CallHook`): after every call of every door,
  ``(resource, method, result, seconds)``; :func:`observed` times a call into it.
* **One stream of a board** (:func:`board_stream`): the device plugin's ListAndWatch and
  the DRA health stream each send a message at once and after every change of their
  health board, waiting on the loop between changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import os
import socket
import stat
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: Threads for the unary calls of every server (the kubelet admits one container at a time).
UNARY_WORKERS = 4
#: gRPC messages up to this size are accepted (a device list can be large).
MAX_RECEIVE_BYTES = 64 << 20

#: Called after every call of every door: (resource, method, result, seconds). ``resource``
#: is the full resource name (``gpushare.io/gpu-memory``) or the DRA driver's name,
#: ``method`` the gRPC method, ``result`` ``ok`` or why not (``invalid``, ``error``, ...).
CallHook = Callable[[str, str, str, float], None]


@dataclass
class CallResult:
    """The result label of one call being answered; the door sets it when not ``ok``."""

    result: str = "ok"


@contextlib.contextmanager
def observed(hook: CallHook | None, resource: str, method: str) -> Iterator[CallResult]:
    """Time the call in the ``with`` block into ``hook``: its result is the outcome's
    (``error`` if the block raised with the result still ``ok``)."""
    outcome = CallResult()
    started = time.perf_counter()
    try:
        yield outcome
    except BaseException:
        if outcome.result == "ok":
            outcome.result = "error"
        raise
    finally:
        if hook is not None:
            hook(resource, method, outcome.result, time.perf_counter() - started)


class ServerLoop:
    """The one event loop thread all gRPC servers of the process run on, and the pool
    their unary calls run in. Started on first use; idle, it sleeps in ``epoll``."""

    _shared: ServerLoop | None = None
    _shared_lock = threading.Lock()

    def __init__(self, workers: int = UNARY_WORKERS) -> None:
        self.loop = asyncio.new_event_loop()
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc")
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-loop", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> ServerLoop:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def run(self, coroutine: Awaitable[Any], timeout: float | None = 30.0) -> Any:
        """Run ``coroutine`` on the loop from another thread; its result."""

        async def wrapper() -> Any:
            return await coroutine

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout)


#: Which socket a path holds: its device, inode and change time (:func:`socket_identity`).
SocketIdentity = tuple[int, int, int]


class WatchedBoard(Protocol):
    """What a stream watches (a health board): a version bumped by every change, and
    listeners called after each (and once more when the board is woken at stop)."""

    version: int

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]: ...


async def board_stream(
    board: WatchedBoard,
    stopping: threading.Event,
    message: Callable[[], T],
    wait_seconds: float,
    *,
    resend_when_quiet: bool = False,
) -> AsyncGenerator[T, None]:
    """``message()`` at once and after every change of ``board``, until ``stopping``.
    Between changes it waits on the loop, holding no thread, at most ``wait_seconds`` at
    a time (then it looks at ``stopping`` again; with ``resend_when_quiet`` it sends the
    message again too). A cancelled stream ends at its await. Iterate it inside
    ``contextlib.aclosing`` so that the board forgets it as soon as the caller ends."""
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(changed.set)

    forget = board.listen(wake)  # every change, and the board's wake at stop
    try:
        seen: int | None = None
        while not stopping.is_set():
            changed.clear()
            if board.version != seen:
                seen = board.version
                yield message()
                continue
            try:
                await asyncio.wait_for(changed.wait(), wait_seconds)
            except TimeoutError:
                if resend_when_quiet:
                    seen = None  # nothing changed: the message again
    finally:
        forget()


def socket_identity(path: Path) -> SocketIdentity | None:
    """Which socket is at ``path`` now (None: none): its device, inode and change time,
    so that a socket made again, even on a reused inode, is told from the old one. The
    one test of "is it still the same socket" of the process: our own served sockets,
    the kubelet's registration socket (a kubelet restart makes it again)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_ctime_ns


def clear_socket(path: Path) -> None:
    """Remove a socket left at ``path`` by an earlier run; anything else there is an
    error (never a file or link to follow)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(f"{path} exists and is not a socket")
    path.unlink()


class Listener(enum.Enum):
    """What a ``connect(2)`` to a socket path found (:func:`probe_socket`)."""

    #: a process accepted (or queued) the connection: the socket is served
    ANSWERS = "answers"
    #: ``ECONNREFUSED``: a socket nobody listens on (its process is gone)
    REFUSED = "refused"
    #: nothing there (any more), or not a socket
    ABSENT = "absent"
    #: anything else (a full backlog, a timeout, no permission): assume it is served
    UNKNOWN = "unknown"


def probe_socket(path: Path, timeout: float = 1.0) -> Listener:
    """Connect to the unix socket at ``path`` and close at once: whether a process listens
    there. Only :attr:`Listener.REFUSED` says for certain that none does."""
    try:
        info = os.lstat(path)
    except OSError:
        return Listener.ABSENT
    if not stat.S_ISSOCK(info.st_mode):
        return Listener.ABSENT
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            return Listener.REFUSED
        except FileNotFoundError:
            return Listener.ABSENT
        except OSError as exc:
            return Listener.REFUSED if exc.errno == errno.ECONNREFUSED else Listener.UNKNOWN
    return Listener.ANSWERS


def remove_if_unserved(path: Path) -> bool:
    """Remove the socket at ``path`` if no process listens on it (a ``connect(2)`` refused)
    and it is still the socket probed (never a file or link, never one that answers, never
    one made there meanwhile). Whether it was removed."""
    before = socket_identity(path)
    if before is None or probe_socket(path) is not Listener.REFUSED:
        return False
    if socket_identity(path) != before:
        return False
    try:
        clear_socket(path)
    except OSError:
        return False
    return True


class UnixSocket:
    """One served unix socket: bound hidden, published by a rename, removed only while
    it is still the one this instance made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.hidden = path.with_name(f".{path.name}.{os.getpid()}-{id(self):x}")
        self._made: SocketIdentity | None = None

    def address(self) -> str:
        """Where the server binds: the hidden name, cleared of an earlier run's socket."""
        clear_socket(self.hidden)
        return f"unix://{self.hidden}"

    def publish(self) -> None:
        """Make the bound socket private and rename it into place (over an earlier run's)."""
        os.chmod(self.hidden, 0o600)
        os.rename(self.hidden, self.path)
        self._made = socket_identity(self.path)

    def intact(self) -> bool:
        """False when our socket was removed or replaced (a kubelet restart does this)."""
        return self._made is not None and socket_identity(self.path) == self._made

    def remove(self) -> None:
        """Remove the socket if it is still ours (never a newer instance's)."""
        if self.intact():
            with contextlib.suppress(OSError):
                clear_socket(self.path)
        self._made = None


#: Adds one servicer to a server (a generated ``add_<Service>Servicer_to_server`` bound
#: to its servicer).
Service = Callable[[Any], None]


class KubeletServer:
    """One gRPC server on the shared :class:`ServerLoop`, serving ``services`` on each of
    ``sockets`` (published in that order: put the one called last first)."""

    def __init__(
        self,
        services: Sequence[Service],
        sockets: Sequence[Path],
        loop: ServerLoop | None = None,
    ) -> None:
        self.services = list(services)
        self.sockets = [UnixSocket(path) for path in sockets]
        self.loop = loop or ServerLoop.shared()
        self._server: Any = None

    def start(self) -> None:
        for served in self.sockets:
            served.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        self._server = self.loop.run(self._start())
        for served in self.sockets:
            served.publish()

    async def _start(self) -> Any:
        server = grpc.aio.server(
            migration_thread_pool=self.loop.pool,
            options=[("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)],
        )
        for add in self.services:
            add(server)
        for served in self.sockets:
            server.add_insecure_port(served.address())
        await server.start()
        return server

    def intact(self) -> bool:
        """Every socket is still the one this server published."""
        return all(served.intact() for served in self.sockets)

    def stop(self, grace: float = 0.5) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            self.loop.run(server.stop(grace), timeout=grace + 10)
        for served in self.sockets:
            served.remove()
