"""Bounds on what strangers can make a listener hold: connections, threads, time.

Every HTTP listener the project ships (the daemon's metrics and probes, the scheduler
extender's verbs and probes) may be reached by anything on its network. Without bounds,
slow clients (a connection that sends one byte every few seconds, or nothing) each held
a thread and its buffers: 3 466 of them took the daemon from 46 to 131 MiB (issue 23
item 3). :class:`ConnectionGuard` is the rule they all share:

* at most ``max_connections`` connections are served at once, at most
  ``max_per_peer`` of them from one address (so one client cannot take every slot from
  the kubelet's probes or Prometheus);
* a connection beyond either cap is answered ``503`` at once (one short write, no
  thread, no read) and closed;
* a request must be complete and answered within ``deadline`` seconds of its first
  byte (a connection gets the same time for its first request to arrive): past it the
  connection is shut down, however slowly the client trickles bytes.

:class:`GuardedHTTPServer` applies it to ``http.server`` (one thread per admitted
connection, so threads are capped too; the serving loop wakes for deadlines only while
connections are open); :class:`GuardedFactory` to an asyncio protocol factory (aiohttp).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

#: The answer to a connection beyond the caps (then closed).
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n"
)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 64
    max_per_peer: int = 16
    deadline: float = 10.0


class ConnectionGuard:
    """Counts admitted connections, overall and per peer address. Thread-safe."""

    def __init__(self, limits: ConnectionLimits | None = None) -> None:
        self.limits = limits or ConnectionLimits()
        self._lock = threading.Lock()
        self._total = 0
        self._by_peer: dict[str, int] = {}
        self.refused = 0
        self.expired = 0

    def admit(self, peer: str) -> bool:
        with self._lock:
            if (
                self._total >= self.limits.max_connections
                or self._by_peer.get(peer, 0) >= self.limits.max_per_peer
            ):
                self.refused += 1
                return False
            self._total += 1
            self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
            return True

    def release(self, peer: str) -> None:
        with self._lock:
            self._total -= 1
            left = self._by_peer.get(peer, 1) - 1
            if left:
                self._by_peer[peer] = left
            else:
                self._by_peer.pop(peer, None)

    @property
    def active(self) -> int:
        with self._lock:
            return self._total


def _peer_of(address: Any) -> str:
    return str(address[0]) if isinstance(address, tuple) and address else str(address)


def refuse(sock: socket.socket) -> None:
    """Answer 503 without reading and without blocking, and close."""
    try:
        sock.setblocking(False)
        sock.send(REFUSAL)
    except OSError:
        pass
    finally:
        sock.close()


#: Connections beyond the caps wait here (no thread, a small buffer) for their request
#: line: a probe (``QuickAnswer``) is answered from the accepting thread, anything else
#: gets the 503. At most this many at once (and ``max_per_peer`` from one address),
#: each for at most :data:`TRIAGE_SECONDS`.
TRIAGE_MAX = 256
TRIAGE_SECONDS = 1.0
TRIAGE_BYTES = 1024

#: (status, content type, body) for a request path answered without a thread, or None.
QuickAnswer = Callable[[str], "tuple[int, str, bytes] | None"]


@dataclass
class _Waiting:
    sock: socket.socket
    peer: str
    until: float
    data: bytes = b""


class GuardedHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` under a :class:`ConnectionGuard`: one thread per
    admitted connection (at most ``max_connections`` threads). Its handlers speak
    HTTP/1.0 (one request per connection), so the deadline counts from the accept.

    A connection beyond the caps is not served by a thread; if ``quick`` answers its
    request path (the liveness and readiness probes: cheap, and the kubelet restarts
    the daemon when they fail) it is answered from the serving loop, so slow strangers
    filling every slot cannot get the daemon restarted; otherwise it gets the 503.
    Serve with :meth:`serve_until`."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        address: Any,
        handler: Any,
        guard: ConnectionGuard,
        quick: QuickAnswer | None = None,
    ) -> None:
        self.guard = guard
        self.quick = quick
        self._due: list[tuple[float, int, socket.socket]] = []
        self._order = itertools.count()
        self._open: set[int] = set()
        self._due_lock = threading.Lock()
        self._waiting: dict[int, _Waiting] = {}  # fileno -> connection in triage
        self._selector: selectors.BaseSelector | None = None
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = _peer_of(client_address)
        if not self.guard.admit(peer):
            self._triage(request, peer)
            return
        with self._due_lock:
            self._open.add(id(request))
            due = time.monotonic() + self.guard.limits.deadline
            heapq.heappush(self._due, (due, next(self._order), request))
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request, peer)
            raise

    def _forget(self, request: Any, peer: str) -> None:
        with self._due_lock:
            if id(request) not in self._open:
                return
            self._open.discard(id(request))
        self.guard.release(peer)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection cut at its deadline (or by its client) is no error worth a
        traceback; anything else is reported as ``http.server`` does."""
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request, _peer_of(client_address))

    def expire_due(self) -> float | None:
        """Shut down the connections past their deadline (their threads then end on
        the next read or write); seconds until the next deadline, None if none."""
        now = time.monotonic()
        with self._due_lock:
            while self._due:
                at, _n, request = self._due[0]
                if id(request) not in self._open:
                    heapq.heappop(self._due)
                    continue
                if at > now:
                    return at - now
                heapq.heappop(self._due)
                self.guard.expired += 1
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)
            return None

    # -- connections beyond the caps ------------------------------------------------
    def _triage(self, sock: socket.socket, peer: str) -> None:
        same_peer = sum(1 for w in self._waiting.values() if w.peer == peer)
        if (
            self.quick is None
            or self._selector is None
            or len(self._waiting) >= TRIAGE_MAX
            or same_peer >= self.guard.limits.max_per_peer
        ):
            refuse(sock)
            return
        sock.setblocking(False)
        self._waiting[sock.fileno()] = _Waiting(sock, peer, time.monotonic() + TRIAGE_SECONDS)
        self._selector.register(sock, selectors.EVENT_READ)

    def _drop(self, waiting: _Waiting, answer: bytes) -> None:
        assert self._selector is not None
        self._waiting.pop(waiting.sock.fileno(), None)
        self._selector.unregister(waiting.sock)
        with contextlib.suppress(OSError):
            waiting.sock.send(answer)  # small: fits the socket's buffer, never blocks
        waiting.sock.close()

    def _read_waiting(self, waiting: _Waiting) -> None:
        try:
            data = waiting.sock.recv(TRIAGE_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        waiting.data += data
        line, newline, _rest = waiting.data.partition(b"\n")
        if not newline:
            if not data or len(waiting.data) >= TRIAGE_BYTES:
                self._drop(waiting, REFUSAL)
            return
        parts = line.split()
        path = parts[1].decode("ascii", "replace").split("?", 1)[0] if len(parts) >= 2 else ""
        quick = self.quick(path) if self.quick is not None and parts[:1] == [b"GET"] else None
        if quick is None:
            self._drop(waiting, REFUSAL)
            return
        status, content_type, body = quick
        reason = {200: "OK", 503: "Service Unavailable"}.get(status, "Status")
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        self._drop(waiting, head.encode() + body)

    def _expire_waiting(self) -> float | None:
        now = time.monotonic()
        for waiting in [w for w in self._waiting.values() if w.until <= now]:
            self._drop(waiting, REFUSAL)
        return min((w.until - now for w in self._waiting.values()), default=None)

    def serve_until(self, wake: int) -> None:
        """Serve until ``wake`` (a pipe's read end) becomes readable. Sleeps until a
        connection, a request line, a deadline or the wake: no wake-ups while nothing
        is connected."""
        with selectors.DefaultSelector() as selector:
            self._selector = selector
            selector.register(self, selectors.EVENT_READ)
            selector.register(wake, selectors.EVENT_READ)
            try:
                while True:
                    due = [self.expire_due(), self._expire_waiting()]
                    waits = [w for w in due if w is not None]
                    ready = selector.select(min(waits) if waits else None)
                    for key, _events in ready:
                        if key.fileobj == wake:
                            return
                        if key.fileobj is self:
                            self._handle_request_noblock()  # type: ignore[attr-defined]
                        else:
                            waiting = self._waiting.get(key.fd)
                            if waiting is not None:
                                self._read_waiting(waiting)
            finally:
                for waiting in list(self._waiting.values()):
                    self._drop(waiting, REFUSAL)
                self._selector = None


# -- asyncio (aiohttp) --------------------------------------------------------------------


class _GuardedProtocol(asyncio.Protocol):
    """One connection's protocol, wrapped: refused beyond the caps; aborted when a
    request is not answered ``deadline`` seconds after its first byte."""

    def __init__(self, inner: Any, guard: ConnectionGuard, registry: dict[Any, Any]) -> None:
        self.inner = inner
        self.guard = guard
        self.registry = registry
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.admitted = False
        self.timer: asyncio.TimerHandle | None = None
        self.done = False  # the current request's answer is prepared

    def _arm(self) -> None:
        if self.timer is None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.guard.limits.deadline, self._expire)

    def _expire(self) -> None:
        self.timer = None
        transport = self.transport
        if self.done and transport is not None and not transport.get_write_buffer_size():
            return  # answered and written out: an idle kept-alive connection (keep-alive ends it)
        self.guard.expired += 1
        if transport is not None:
            transport.abort()

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def answered(self) -> None:
        """The answer is prepared. The deadline still covers writing it: a client that
        does not read its answer is cut when it passes (the answer waits in our buffer)."""
        self.done = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.peer = _peer_of(transport.get_extra_info("peername"))
        if not self.guard.admit(self.peer):
            transport.write(REFUSAL)
            transport.close()
            return
        self.admitted = True
        self.registry[transport] = self
        self._arm()  # the first request must come, and be answered, in time
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            if self.done:  # the next request on a kept-alive connection: a deadline of its own
                self.done = False
                self._cancel()
            self._arm()
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self.admitted:
            return None
        return bool(self.inner.eof_received())

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.admitted:
            return
        self._cancel()
        self.admitted = False
        self.registry.pop(self.transport, None)
        self.guard.release(self.peer)
        self.inner.connection_lost(exc)


class GuardedFactory:
    """An asyncio protocol factory under a :class:`ConnectionGuard`. The server calls
    :meth:`answered` with a request's transport once its answer is ready; the deadline
    then still runs until the answer is written out (a client that does not read it is
    cut), after which a kept-alive connection waits for its next request without a
    deadline (the server's own keep-alive timeout closes it)."""

    def __init__(self, factory: Callable[[], Any], guard: ConnectionGuard) -> None:
        self.factory = factory
        self.guard = guard
        self._connections: dict[Any, _GuardedProtocol] = {}

    def __call__(self) -> _GuardedProtocol:
        return _GuardedProtocol(self.factory(), self.guard, self._connections)

    def answered(self, transport: Any) -> None:
        protocol = self._connections.get(transport)
        if protocol is not None:
            protocol.answered()
