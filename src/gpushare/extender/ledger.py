"""Pods the extender let through whose use the node's annotation does not show yet.

Between the filter verb and the daemon's next annotation update there is a window
(binding, kubelet admission, the daemon's debounce) in which the annotation still shows
the cards as they were. Without a record of what it just let through, the extender
would keep a burst of pods on a node as long as the annotation said one card had room
for ONE of them. The ledger keeps, per (pod UID, node), the units the pod is predicted
to take on each card and the annotation generation it was decided against. An entry
goes away when the node's generation moves past that one (the daemon has counted
whatever was admitted since; any change counts, so a restarted daemon's reset counter
does too), when it is older than the timeout, or when the same pod
is filtered again (it was not bound after all, or the scheduler is retrying it).

A pod is usually kept on several nodes and bound to one; on the others its entry holds
room until the daemon's periodic update (at least every 30 s) moves the generation.
That errs on the side of not overcommitting; a pod dropped for it is retried when the
annotation changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LedgerEntry:
    pod_uid: str
    node: str
    generation: int
    admitted_at: float
    use_by_card: Mapping[str, tuple[int, int]]  # UUID -> (memory units, core units)


class AdmissionLedger:
    """Not thread-safe: the extender's handlers run on one event loop."""

    def __init__(self, timeout_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._entries: dict[tuple[str, str], LedgerEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        horizon = self._clock() - self.timeout_seconds
        for key in [k for k, e in self._entries.items() if e.admitted_at < horizon]:
            del self._entries[key]

    def forget_pod(self, pod_uid: str) -> None:
        """Drop every entry of this pod (it is being filtered again)."""
        for key in [k for k in self._entries if k[0] == pod_uid]:
            del self._entries[key]

    def pending_use(
        self, node: str, generation: int, exclude_pod: str = ""
    ) -> dict[str, tuple[int, int]]:
        """UUID -> (memory, core) units held on ``node`` by pods not yet in ``generation``
        (other than ``exclude_pod``)."""
        self._expire()
        total: dict[str, tuple[int, int]] = {}
        for key in [k for k in self._entries if k[1] == node]:
            entry = self._entries[key]
            if generation != entry.generation:  # moved on (or the daemon restarted)
                del self._entries[key]
                continue
            if entry.pod_uid == exclude_pod:
                continue
            for uuid, (memory, core) in entry.use_by_card.items():
                held_memory, held_core = total.get(uuid, (0, 0))
                total[uuid] = (held_memory + memory, held_core + core)
        return total

    def pending_pods(self, node: str, exclude_pod: str = "") -> int:
        return sum(1 for pod, on in self._entries if on == node and pod != exclude_pod)

    def record(
        self,
        pod_uid: str,
        node: str,
        generation: int,
        use_by_card: Mapping[str, tuple[int, int]],
    ) -> None:
        if not pod_uid or not use_by_card:
            return
        self._entries[(pod_uid, node)] = LedgerEntry(
            pod_uid, node, generation, self._clock(), dict(use_by_card)
        )
