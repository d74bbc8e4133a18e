"""Who held units before the kubelet restarted, until its records list them again.

A restarted kubelet keeps its allocations (its checkpoint) but lists in PodResources only
the pods it has admitted again: the first batch is admitted one pod at a time, in
creation order, and until its pod sources are ready it also keeps the devices of pods
deleted just before the restart (v1.36 ``devicemanager.UpdateAllocatedDevices`` returns
early). Meanwhile the records understate what is held. The kubelet's offer of the
resource asked shows it (``Snapshot.unlisted_on``); the *other* resource's count does
not: a running pod asking memory units only holds no core, so a container whose cores
are asked first could be bound to that pod's card and then be refused its memory there
(issue 32.14).

:class:`RestartHolders` keeps the holders of the last records read before the restart
(and those listed in the last :data:`RECENT_SECONDS`: the restarted kubelet's first,
empty records may be read before its new socket is noticed) and, while any of them is
not listed again, counts their units on their cards as held.
A holder leaves when the records list it again; one whose pod is gone or being deleted
(the pod specs say so) leaves at once: the kubelet frees its devices at its next
``UpdateAllocatedDevices`` (every ``List`` runs one), and while it still counts them it
refuses by its own count, which no card choice avoids. Every holder leaves after
:data:`LONGEST_SECONDS` (logged by the caller). While any is left the node's records are
incomplete: the daemon publishes the restart in its node state and the scheduler
extender sends no pod there.

Pure: fed with plain data and a clock, no I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping

from gpushare.share.devices import Resource
from gpushare.share.usage import Holder

#: The longest a holder listed before the restart is waited for.
LONGEST_SECONDS = 600.0
#: A holder the records stopped listing this recently is still expected after a restart:
#: the restarted kubelet's empty records may be read before its new socket is noticed.
RECENT_SECONDS = 60.0

ByCard = Mapping[str, Mapping[Holder, Mapping[Resource, int]]]


class RestartHolders:
    """Thread-safe; ``clock`` is monotonic seconds, ``wall`` seconds since the epoch."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._last: dict[str, dict[Holder, dict[Resource, int]]] = {}
        #: (card, holder) -> (units, clock time last listed), listed within RECENT_SECONDS
        self._recent: dict[tuple[str, Holder], tuple[dict[Resource, int], float]] = {}
        #: the kubelet (its socket's identity) whose records ``_last`` holds
        self._kubelet: object = None
        #: card -> holder -> units: listed before the restart, not listed since
        self._missing: dict[str, dict[Holder, dict[Resource, int]]] = {}
        self._since: float | None = None  # clock time of the restart, while incomplete
        self._since_wall = ""
        #: called (outside the lock) when the records become incomplete or complete
        self.listeners: list[Callable[[], None]] = []

    def kubelet_restarted(self) -> None:
        """The kubelet restarted: every holder of the last records is expected again."""
        with self._lock:
            self._kubelet = None  # the next kubelet's records are the ones to keep
            for uuid, holders in self._last.items():
                for holder, units in holders.items():
                    self._missing.setdefault(uuid, {})[holder] = dict(units)
            for (uuid, holder), (units, _at) in self._recent.items():
                self._missing.setdefault(uuid, {}).setdefault(holder, dict(units))
            self._recent.clear()
            if not self._missing:
                return  # nothing was held: nothing can be missing
            self._since = self._clock()
            self._since_wall = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._wall()))
        self._notify()

    def records_read(
        self,
        by_card: ByCard,
        alive: Callable[[Holder], bool] | None = None,
        kubelet: object = None,
    ) -> int:
        """A PodResources read (``Snapshot.holders_by_card``); ``alive``: whether the
        holder's pod still exists (None: unknown); ``kubelet``: which kubelet answered
        (its socket's identity): the records of a new kubelet read before its restart is
        reported never replace the old one's. Returns how many holders were given up
        waiting for (:data:`LONGEST_SECONDS`)."""
        listed = {holder for holders in by_card.values() for holder in holders}
        given_up = 0
        with self._lock:
            was_incomplete = self._since is not None
            if self._since is None:
                if self._kubelet is None or kubelet is None or kubelet == self._kubelet:
                    self._last = _copy(by_card)
                    self._kubelet = kubelet
                    self._remember(by_card)
                return 0
            elapsed = self._clock() - self._since
            for uuid in list(self._missing):
                holders = self._missing[uuid]
                for holder in list(holders):
                    gone = alive is not None and not alive(holder)
                    # A pod known to be gone holds nothing for placement: a restarted
                    # kubelet that still counts it refuses by its own count, which no
                    # card choice of ours can avoid (the real kubelet was seen offering
                    # that room at once; counting it steered cores to the wrong card).
                    if holder in listed or gone:
                        del holders[holder]
                    elif elapsed >= LONGEST_SECONDS:
                        del holders[holder]
                        given_up += 1
                if not holders:
                    del self._missing[uuid]
            if not self._missing:
                self._since, self._since_wall = None, ""
                self._last, self._kubelet = _copy(by_card), kubelet
                self._remember(by_card)
            now_complete = self._since is None
        if was_incomplete and now_complete:
            self._notify()
        return given_up

    def _remember(self, by_card: ByCard) -> None:
        """Note who the records list now; forget who they stopped listing long ago."""
        now = self._clock()
        for uuid, holders in by_card.items():
            for holder, units in holders.items():
                self._recent[(uuid, holder)] = (dict(units), now)
        horizon = now - RECENT_SECONDS
        for key in [k for k, (_u, at) in self._recent.items() if at < horizon]:
            del self._recent[key]

    def held(
        self,
        resource: Resource,
        listed: Collection[Holder] = (),
        alive: Callable[[Holder], bool] | None = None,
    ) -> dict[str, int]:
        """Per card, the units of ``resource`` the holders not listed again hold, leaving
        out those ``listed`` (the records in the caller's hand, which may be newer than
        the last read fed here: a holder they list is counted by them already) and those
        whose pod is gone or being deleted by now (``alive``, as :meth:`records_read`)."""
        with self._lock:
            return {
                uuid: total
                for uuid, holders in self._missing.items()
                if (
                    total := sum(
                        units.get(resource, 0)
                        for holder, units in holders.items()
                        if holder not in listed and (alive is None or alive(holder))
                    )
                )
            }

    def restarted_at(self) -> str:
        """The restart's UTC time while the records are incomplete, else ""."""
        with self._lock:
            return self._since_wall

    def waiting_for(self) -> int:
        with self._lock:
            return sum(len(holders) for holders in self._missing.values())

    def _notify(self) -> None:
        for listener in list(self.listeners):
            listener()


def _copy(by_card: ByCard) -> dict[str, dict[Holder, dict[Resource, int]]]:
    return {uuid: {h: dict(u) for h, u in hs.items()} for uuid, hs in by_card.items()}
