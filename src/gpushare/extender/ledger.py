"""Pods bound by the extender whose use the node's annotation does not show yet.

The extender learns where a pod goes from the ``bind`` verb: kube-scheduler hands it
the node it chose, and the extender posts the Binding itself. Only then does the pod
hold room, and only on that node: a pod that was filtered but not bound (the scheduler
chose another node, the pod was deleted, or the request came from someone else)
holds nothing anywhere.

Between the binding and the daemon's next annotation update there is a window
(kubelet admission, the daemon's debounce) in which the node's annotation still shows
its cards as they were. A hold keeps the pod's predicted units per card on top of
that annotation until the node's generation moves past the one the binding was
decided against (the daemon has counted whatever was admitted since; any change
counts, so a restarted daemon's reset counter does too), or until it is older than
the timeout, whichever comes first.

Every operation is O(1) amortised or linear in one node's holds: entries are kept
per node, and in insertion order (which is also time order) for expiry. The number
of holds is bounded; past the bound the oldest goes first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: The most holds kept at once (a cluster binds far fewer pods per minute).
DEFAULT_MAX_HOLDS = 10_000


@dataclass(frozen=True)
class LedgerEntry:
    pod_uid: str
    node: str
    generation: int
    admitted_at: float
    use_by_card: Mapping[str, tuple[int, int]]  # UUID -> (memory units, core units)


class AdmissionLedger:
    """Not thread-safe: the extender's handlers run on one event loop."""

    def __init__(
        self,
        timeout_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        max_holds: int = DEFAULT_MAX_HOLDS,
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self.max_holds = max_holds
        self._clock = clock
        self._by_time: OrderedDict[str, LedgerEntry] = OrderedDict()  # pod UID -> entry
        self._by_node: dict[str, dict[str, LedgerEntry]] = {}  # node -> pod UID -> entry

    def __len__(self) -> int:
        return len(self._by_time)

    def _drop(self, pod_uid: str) -> None:
        entry = self._by_time.pop(pod_uid, None)
        if entry is None:
            return
        on_node = self._by_node.get(entry.node)
        if on_node is not None:
            on_node.pop(pod_uid, None)
            if not on_node:
                del self._by_node[entry.node]

    def _expire(self) -> None:
        horizon = self._clock() - self.timeout_seconds
        while self._by_time:
            uid, entry = next(iter(self._by_time.items()))
            if entry.admitted_at >= horizon:
                break
            self._drop(uid)

    def forget_pod(self, pod_uid: str) -> None:
        """Drop the pod's hold (its binding failed, or it is being scheduled again)."""
        self._drop(pod_uid)

    def holds(self, pod_uid: str) -> bool:
        return pod_uid in self._by_time

    def pending_use(
        self, node: str, generation: int, exclude_pod: str = ""
    ) -> dict[str, tuple[int, int]]:
        """UUID -> (memory, core) units held on ``node`` by pods not yet in ``generation``
        (other than ``exclude_pod``)."""
        self._expire()
        total: dict[str, tuple[int, int]] = {}
        for entry in list(self._by_node.get(node, {}).values()):
            if generation != entry.generation:  # moved on (or the daemon restarted)
                self._drop(entry.pod_uid)
                continue
            if entry.pod_uid == exclude_pod:
                continue
            for uuid, (memory, core) in entry.use_by_card.items():
                held_memory, held_core = total.get(uuid, (0, 0))
                total[uuid] = (held_memory + memory, held_core + core)
        return total

    def pending_pods(self, node: str, exclude_pod: str = "") -> int:
        return sum(1 for uid in self._by_node.get(node, {}) if uid != exclude_pod)

    def record(
        self,
        pod_uid: str,
        node: str,
        generation: int,
        use_by_card: Mapping[str, tuple[int, int]],
    ) -> None:
        """The pod holds ``use_by_card`` on ``node`` (replacing any hold it had)."""
        self._drop(pod_uid)
        if not pod_uid or not use_by_card:
            return
        self._expire()
        while len(self._by_time) >= self.max_holds:
            self._drop(next(iter(self._by_time)))
        entry = LedgerEntry(pod_uid, node, generation, self._clock(), dict(use_by_card))
        self._by_time[pod_uid] = entry
        self._by_node.setdefault(node, {})[pod_uid] = entry
