"""Freed units reach the Node's published state within about a second.

The kubelet frees a pod's device-plugin units once the pod is gone: deleted, or
finished (``Succeeded``/``Failed``). The daemon learns it from two places:

* the pod watch (this node's pods): a pod that is deleted or reaches a terminal phase
  makes the kubelet's records be read again at once (:meth:`UsageRefresher.poke`);
  while a read still shows such a pod holding units (the kubelet removes it from its
  records a moment after the API server tells), they are read again, every
  refresher debounce, for up to :data:`RELEASE_WAIT_SECONDS`;
* every read of the kubelet's records (the periodic one included): when the units or
  the pods they count differ from the last read, the API link is woken to publish.

The API link coalesces the wake-ups (see ``apilink.py``): a burst of deletions costs
one Node update, never more than a few per second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import structlog

from gpushare.share.records import Snapshot

log = structlog.get_logger(__name__)

#: How long a pod the API server reports gone is waited for in the kubelet's records.
RELEASE_WAIT_SECONDS = 10.0
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


class _Refresher(Protocol):
    read_listeners: list[Callable[[Snapshot], object]]

    def poke(self) -> None: ...


class _Link(Protocol):
    pod_listeners: list[Callable[[list[dict[str, Any]]], None]]

    def notify_changed(self) -> None: ...


def _name(pod: Mapping[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _live(pod: Mapping[str, Any]) -> bool:
    return str((pod.get("status") or {}).get("phase") or "") not in TERMINAL_PHASES


class ReleaseWatch:
    """Turns pod endings and fresh records into prompt Node updates (thread-safe)."""

    def __init__(
        self,
        poke: Callable[[], None],
        publish: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._poke = poke
        self._publish = publish
        self._clock = clock
        self._lock = threading.Lock()
        self._live: set[tuple[str, str]] = set()  # this node's live pods at the last event
        self._awaited: dict[tuple[str, str], float] = {}  # gone pods -> give up at
        self._last_view: Any = None
        self.released_seen = 0  # pods seen ending, for tests and metrics

    def pods_changed(self, pods: Sequence[Mapping[str, Any]]) -> None:
        """Every pod of the node (after a list or a watch event): which ones ended."""
        live = {_name(pod) for pod in pods if _live(pod)}
        with self._lock:
            ended = self._live - live
            self._live = live
            deadline = self._clock() + RELEASE_WAIT_SECONDS
            for name in ended - live:
                self._awaited[name] = deadline
            self.released_seen += len(ended)
        if ended:
            log.debug("pods_ended", pods=len(ended))
            self._poke()

    def records_read(self, snapshot: Snapshot) -> None:
        """After each read of the kubelet's records: publish what changed, and read again
        soon while a pod that ended still shows."""
        holding = {(h.namespace, h.pod) for h in snapshot.devices}
        view = (snapshot.used_counts, frozenset(snapshot.devices))
        now = self._clock()
        with self._lock:
            changed = view != self._last_view
            self._last_view = view
            for name, deadline in list(self._awaited.items()):
                if name not in holding or now >= deadline:
                    del self._awaited[name]
            again = bool(self._awaited)
        if changed:
            self._publish()
        if again:
            self._poke()


def watch_releases(refresher: _Refresher, link: _Link) -> ReleaseWatch:
    """Wire a :class:`ReleaseWatch` between the pod watch, the records and the API link."""
    watch = ReleaseWatch(refresher.poke, link.notify_changed)
    link.pod_listeners.append(watch.pods_changed)
    refresher.read_listeners.append(watch.records_read)
    return watch
