"""Keeps the usage ledger in step with the kubelet's records (PodResources ``List``).

The kubelet's records are the only truth about allocations. They are read:

* once when the daemon starts, before it registers, so that a daemon restarted in
  the middle of a busy node (even after ``kill -9``) agrees with the kubelet at once;
* every ``pod_resources_interval_seconds`` when nothing happens;
* shortly after an Allocate (debounced: a burst of admissions costs one read);
* every :data:`HURRY_SECONDS` while ``hurry`` says so: after a kubelet restart, until
  its records list every container again (the node is kept from the scheduler
  extender meanwhile, so no Allocate comes to prompt a read; issue 32.14).

A socket that is missing or failing is retried with growing delays and never stops
the daemon. After each fresh read the caller's ``after_read`` hook runs (garbage
collection needs a successful read to know what is no longer in use).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import structlog

from gpushare.share.records import Snapshot
from gpushare.share.usage import UsageLedger

log = structlog.get_logger(__name__)

#: Wait this long after an Allocate for more to follow before reading the records.
DEBOUNCE_SECONDS = 0.2
#: ...but never longer than this after the first Allocate of a burst.
DEBOUNCE_LIMIT_SECONDS = 1.0
#: Delays between reads while the socket is missing or failing: first, longest.
RETRY_SECONDS = (0.5, 30.0)
#: Between reads while ``hurry`` says the records are awaited (one List a second; the
#: kubelet allows 100).
HURRY_SECONDS = 1.0


class UsageRefresher:
    """A thread that reads PodResources and replaces the ledger's view with it."""

    def __init__(
        self,
        read: Callable[[], Snapshot | None],
        ledger: UsageLedger,
        interval_seconds: float,
        *,
        after_read: Callable[[Snapshot], object] | None = None,
        read_listeners: Sequence[Callable[[Snapshot], object]] = (),
        hurry: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._ledger = ledger
        self._interval = interval_seconds
        self.after_read = after_read
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poked_first: float | None = None  # first Allocate of the pending burst
        self._poked_last: float | None = None
        #: Also called with every snapshot adopted, after ``after_read``.
        self.read_listeners: list[Callable[[Snapshot], object]] = list(read_listeners)
        #: True while fresh records are awaited: read every HURRY_SECONDS, not the interval
        self.hurry = hurry
        self.reads = 0  # successful reads adopted, for tests and metrics
        self.failures = 0

    # -- control ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pod-resources", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def poke(self) -> None:
        """An allocation happened: read the records again soon."""
        now = self._clock()
        with self._lock:
            if self._poked_first is None:
                self._poked_first = now
            self._poked_last = now
        self._wake.set()

    # -- work ------------------------------------------------------------------------
    def refresh_once(self) -> bool:
        """Read the records now and adopt them; False if they could not be read."""
        asked_at = self._clock()
        try:
            snapshot = self._read()
        except Exception as exc:  # the client never raises, but a refresh must not die
            log.warning("pod_resources_read_failed", error=str(exc))
            snapshot = None
        if snapshot is None:
            self.failures += 1
            return False
        if snapshot.taken_at < asked_at:
            return True  # the rate limit handed back an older answer: nothing new
        try:
            self._ledger.replace(
                snapshot.used_by_card(),
                snapshot.holders_by_card(),
                snapshot.taken_at,
                snapshot.numbers_by_holder(),
            )
        except Exception:  # the kubelet's records are data: no record may end this thread
            log.exception("pod_resources_not_adopted")
            self.failures += 1
            return False
        self.reads += 1
        for hook in [self.after_read, *self.read_listeners]:
            if hook is None:
                continue
            try:
                hook(snapshot)
            except Exception:
                log.exception("after_pod_resources_read_failed")
        return True

    def _next_interval(self) -> float:
        hurry = self.hurry
        try:
            hurried = hurry is not None and hurry()
        except Exception:  # a hook must not end this thread
            log.exception("pod_resources_hurry_failed")
            hurried = False
        return min(self._interval, HURRY_SECONDS) if hurried else self._interval

    def _due_after_poke(self) -> float | None:
        with self._lock:
            if self._poked_first is None or self._poked_last is None:
                return None
            return min(
                self._poked_last + DEBOUNCE_SECONDS,
                self._poked_first + DEBOUNCE_LIMIT_SECONDS,
            )

    def _run(self) -> None:
        retry, longest = RETRY_SECONDS
        next_read = self._clock() + self._interval
        while not self._stop.is_set():
            due = next_read
            poked_due = self._due_after_poke()
            if poked_due is not None:
                due = min(due, poked_due)
            self._wake.wait(max(0.0, due - self._clock()))
            self._wake.clear()
            if self._stop.is_set():
                return
            now = self._clock()
            poked_due = self._due_after_poke()
            if now < next_read and (poked_due is None or now < poked_due):
                continue  # woken by a poke whose debounce has not run out yet
            with self._lock:
                self._poked_first = self._poked_last = None
            if self.refresh_once():
                retry = RETRY_SECONDS[0]
                next_read = self._clock() + self._next_interval()
            else:
                next_read = self._clock() + min(retry, self._interval)
                retry = min(retry * 2, longest)
