"""Per-card health: the board the device lists are built from.

Every change bumps a version number and wakes whoever waits on the board (the
ListAndWatch streams), so a card going bad reaches the kubelet at once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from gpushare.base.dirwatch import StopEvent
from gpushare.gpu.gpus import GpuBackend, GpuEvent, MigDevice

log = structlog.get_logger(__name__)


class HealthReader(Protocol):
    """What a device's health is read from (a :class:`HealthBoard`)."""

    def is_healthy(self, key: str) -> bool: ...

    def reason(self, key: str) -> str: ...


class HealthBoard:
    """Thread-safe map card UUID -> healthy, with change notification."""

    def __init__(
        self, uuids: Iterable[str], event: str = "gpu_health_changed", level: str = "warning"
    ) -> None:
        self._healthy = dict.fromkeys(uuids, True)
        self._reasons: dict[str, str] = {}
        self._changed = threading.Condition()
        # The log event and level of a change (boards derived from this one differ).
        self._event, self._level = event, level
        #: Called after every change, outside the lock (boards derived from this one).
        self.listeners: list[Callable[[], None]] = []
        self._wakers: list[Callable[[], None]] = []  # also called by :meth:`wake`
        self.version = 0

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (quick, non-blocking) after every change and every
        :meth:`wake`, from the thread that made it; returns the function that stops it."""
        with self._changed:
            self.listeners.append(callback)
            self._wakers.append(callback)

        def forget() -> None:
            with self._changed:
                for registered in (self.listeners, self._wakers):
                    if callback in registered:
                        registered.remove(callback)

        return forget

    def is_healthy(self, uuid: str) -> bool:
        return self._healthy.get(uuid, False)

    def cards(self) -> list[str]:
        return list(self._healthy)

    def healthy_cards(self) -> list[str]:
        return [uuid for uuid, ok in self._healthy.items() if ok]

    def reason(self, uuid: str) -> str:
        return self._reasons.get(uuid, "")

    def set(self, uuid: str, healthy: bool, reason: str = "") -> bool:
        """Record a card's health; True if it changed."""
        with self._changed:
            if uuid not in self._healthy:
                return False
            if self._healthy[uuid] == healthy:
                if not healthy and reason:
                    self._reasons[uuid] = reason  # still unhealthy, for a newer reason
                return False
            self._healthy[uuid] = healthy
            if healthy:
                self._reasons.pop(uuid, None)
            else:
                self._reasons[uuid] = reason
            self.version += 1
            self._changed.notify_all()
        getattr(log, self._level)(self._event, gpu=uuid, healthy=healthy, reason=reason)
        with self._changed:
            listeners = list(self.listeners)
        for listener in listeners:
            listener()
        return True

    def wake(self) -> None:
        """Wake every waiter to re-check its own reason to stop; changes nothing."""
        with self._changed:
            self._changed.notify_all()
            wakers = list(self._wakers)
        for waker in wakers:
            waker()

    def wait_for_change(
        self, seen: int, timeout: float, give_up: Callable[[], bool] = lambda: False
    ) -> int:
        """Block until the version differs from ``seen``, ``give_up()`` holds (checked
        whenever :meth:`wake` is called) or ``timeout`` passes."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != seen or give_up(), timeout)
            return self.version


def unhealthy(board: HealthReader, keys: Iterable[str]) -> str | None:
    """Why a device is refused: the reason of the first of its health ``keys`` (its
    card's, then its own) that ``board`` calls unhealthy, ``"unhealthy"`` where none is
    recorded; None when every key is healthy. The one check every door makes before it
    hands a device out (shared units, whole cards and MIG devices, DRA claims)."""
    for key in keys:
        if not board.is_healthy(key):
            return board.reason(key) or "unhealthy"
    return None


# --------------------------------------------------------------------------- policy


def expand(event: GpuEvent, mig_of: Mapping[str, Sequence[MigDevice]]) -> list[GpuEvent]:
    """The events of every health key an NVML event concerns: itself, and for a card in
    MIG mode its MIG devices too. An XID that names a GPU instance (and compute
    instance) reaches only the MIG devices there; one that names none, or names an
    instance the card is not known to hold, reaches the card and all its MIG devices.
    A MIG device's own event (gone or back, by its ``MIG-`` UUID) reaches only itself."""
    devices = mig_of.get(event.uuid, ())
    if not devices:
        return [event]
    if event.xid is not None and event.gpu_instance is not None:
        hit = [
            device
            for device in devices
            if device.gpu_instance == event.gpu_instance
            and event.compute_instance in (None, device.compute_instance)
        ]
        if hit:
            return [dataclasses.replace(event, uuid=device.uuid) for device in hit]
    return [event] + [dataclasses.replace(event, uuid=device.uuid) for device in devices]


#: XIDs after which a card is not trusted again until it has been seen to come back
#: (79: fallen off the bus; 48: double-bit ECC error, also what NVML's ECC event maps to).
FATAL_XIDS = frozenset({48, 79})


@dataclass(frozen=True)
class Verdict:
    """The policy's decision about one card: what the board should say and why."""

    uuid: str
    healthy: bool
    reason: str


@dataclass
class _CardState:
    bad_since: float | None = None  # clock time of the last non-ignored XID
    last_xid: int | None = None
    fatal: bool = False  # stays unhealthy until the card is seen again
    gone: bool = False
    stale: bool = False  # its MIG mode or layout changed: unhealthy until a restart


class HealthPolicy:
    """Pure decisions over GPU events and the clock; no threads, no NVML.

    * An ignored XID (``ignored`` is None: every XID) changes nothing.
    * Any other XID makes the card unhealthy. If the XID is not fatal, the card is
      healthy again once ``recovery_seconds`` pass without another such XID.
    * A fatal XID (:data:`FATAL_XIDS`) or the card disappearing keeps it unhealthy
      until the card is seen again (a ``gone=False`` event after it was gone).
    * A card whose MIG mode or layout changed is unhealthy for good: what is advertised
      no longer exists; a restart of gpushare reads the new layout.

    Keys are card UUIDs and MIG device UUIDs alike (see :func:`expand`).
    """

    def __init__(
        self,
        uuids: Iterable[str],
        ignored: frozenset[int] | None,
        recovery_seconds: float,
    ) -> None:
        self._ignored = ignored
        self._recovery_seconds = recovery_seconds
        self._cards = {uuid: _CardState() for uuid in uuids}

    def _healthy(self, state: _CardState) -> bool:
        return not state.gone and not state.fatal and not state.stale and state.bad_since is None

    def on_event(self, event: GpuEvent, now: float) -> Verdict | None:
        """The card's new verdict if ``event`` changes it; None if it changes nothing."""
        state = self._cards.get(event.uuid)
        if state is None:
            return None  # a card we do not advertise (MIG, or added after start)
        was_healthy = self._healthy(state)
        if event.mig_changed:
            if state.stale:
                return None
            state.stale = True
            return Verdict(event.uuid, False, self._describe(state))
        if event.xid is None:
            if event.gone:
                state.gone = True
                reason = self._describe(state)
            elif state.gone:
                # Seen again: a fresh card as far as we can tell, fatal history forgotten.
                state.gone = False
                state.fatal = False
                state.bad_since = None
                state.last_xid = None
                reason = "the GPU is visible again" if not state.stale else self._describe(state)
            else:
                return None
            return Verdict(event.uuid, self._healthy(state), reason)
        if self._ignored is None or event.xid in self._ignored:
            return None
        state.last_xid = event.xid
        state.bad_since = now
        if event.xid in FATAL_XIDS:
            state.fatal = True
        if not was_healthy and state.gone:
            return None
        return Verdict(event.uuid, False, self._describe(state))

    def _describe(self, state: _CardState) -> str:
        if state.stale:
            return "the GPU's MIG mode or layout changed; restart gpushare to serve the new one"
        if state.gone:
            return "the GPU is no longer visible (fallen off the bus?)"
        if state.fatal:
            return f"XID {state.last_xid}: unhealthy until the GPU is seen again"
        return (
            f"XID {state.last_xid}: healthy again after {self._recovery_seconds:g} s "
            "without another error"
        )

    def tick(self, now: float) -> list[Verdict]:
        """Cards whose quiet time after a non-fatal XID has run out: healthy again."""
        recovered = []
        for uuid, state in self._cards.items():
            if state.fatal or state.gone or state.stale or state.bad_since is None:
                continue
            if now - state.bad_since >= self._recovery_seconds:
                state.bad_since = None
                recovered.append(Verdict(uuid, True, f"no error for {self._recovery_seconds:g} s"))
        return recovered

    def next_deadline(self) -> float | None:
        """Clock time of the next possible recovery, or None if nothing waits for one."""
        pending = [
            state.bad_since + self._recovery_seconds
            for state in self._cards.values()
            if state.bad_since is not None and not (state.fatal or state.gone or state.stale)
        ]
        return min(pending, default=None)


# --------------------------------------------------------------------------- monitor

#: How long the monitor waits before watching again after the backend's watch failed.
WATCH_RETRY_SECONDS = (1.0, 30.0)


class HealthMonitor:
    """Feeds :class:`HealthBoard` from the backend's events through :class:`HealthPolicy`.

    Two threads: one blocks in ``backend.watch`` (restarted with backoff if it fails),
    the other sleeps until the next recovery is due. Neither ever stops the daemon.
    """

    def __init__(
        self,
        backend: GpuBackend,
        board: HealthBoard,
        policy: HealthPolicy,
        clock: Callable[[], float] = time.monotonic,
        mig_of: Mapping[str, Sequence[MigDevice]] | None = None,
        mig_board: HealthBoard | None = None,
    ) -> None:
        self._backend = backend
        self._board = board
        self._policy = policy
        self._mig_of = dict(mig_of or {})  # card UUID -> its MIG devices
        # The MIG cards and devices have a board of their own (``board``'s keys are the
        # cards the shared resources are built from).
        self._mig_board = mig_board
        self._mig_keys = set(mig_board.cards()) if mig_board is not None else set()
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = StopEvent()  # also wakes a backend blocked on a file descriptor
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, target in (("gpu-events", self._watch), ("gpu-recovery", self._recover)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=5.0)

    def deliver(self, event: GpuEvent) -> None:
        """Apply one event to the board (called from the backend's watch)."""
        log.info(
            "gpu_event",
            gpu=event.uuid,
            xid=event.xid,
            gone=event.gone,
            gpu_instance=event.gpu_instance,
            compute_instance=event.compute_instance,
            mig_changed=event.mig_changed,
        )
        with self._lock:  # decide and record together, so a recovery cannot undo it
            now = self._clock()
            for one in expand(event, self._mig_of):
                verdict = self._policy.on_event(one, now)
                if verdict is not None:
                    self._record(verdict)
        self._wake.set()

    def _watch(self) -> None:
        delay, longest = WATCH_RETRY_SECONDS
        while not self._stop.is_set():
            try:
                self._backend.watch(self.deliver, self._stop)
                return
            except Exception as exc:  # NVML can fail in many ways; health must go on
                log.warning("gpu_watch_failed", error=str(exc), retry_seconds=delay)
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, longest)

    def _recover(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                deadline = self._policy.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - self._clock())
            self._wake.wait(timeout)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                for verdict in self._policy.tick(self._clock()):
                    self._record(verdict)

    def _record(self, verdict: Verdict) -> None:
        mig = self._mig_board is not None and verdict.uuid in self._mig_keys
        board = self._mig_board if mig and self._mig_board is not None else self._board
        board.set(verdict.uuid, verdict.healthy, verdict.reason)
