"""The pairing rule's desk: what the binder knows of the containers being admitted.

Whether a request is the second resource of the container bound last is decided by
:func:`~gpushare.share.pairing.decide` (pure) from facts gathered here: the kubelet's
PodResources records, read after the request arrived (never an older answer; the read
is bounded by :data:`RECORDS_WAIT`), and the pod specs of the node. The desk keeps the
rule's memory (:class:`~gpushare.share.pairing.Pairing`: the binding made last) and
the decision GetPreferredAllocation made, for the Allocate of the same binding that
follows it. No lock is held across I/O: the records are read outside :attr:`_lock`.
"""

from __future__ import annotations

import threading
from typing import Protocol

import structlog

from gpushare.kube.podspecs import PodSpecBook
from gpushare.share.devices import Resource
from gpushare.share.pairing import Binding, Decision, Facts, Pairing, decide
from gpushare.share.records import Snapshot

log = structlog.get_logger(__name__)

#: How long a request waits for the kubelet's records before deciding without them.
#: The kubelet waits for GetPreferredAllocation and Allocate without a deadline (v1.36
#: ``ManagerImpl.Allocate``: ``context.TODO()``), and a missing or refusing socket
#: answers at once, so only a kubelet that answers slowly is waited for; deciding
#: without its records pairs by the fallback, which refuses containers the records
#: would admit (issue 32.18: 0.2 s here refused 20 of 150 pods of ``make simulate``
#: with the extender when every ``List`` took 0.3 s).
RECORDS_WAIT = 5.0


class PodResourceRecords(Protocol):
    """The kubelet's PodResources records (``podresources.PodResourcesClient``)."""

    last: Snapshot | None
    last_error: str

    def read_after(self, not_before: float, *, timeout: float) -> Snapshot | None:
        """A snapshot whose read began at or after ``not_before``; None if none in time."""
        ...


#: A decision, with the binding it was made after and the records it was made from.
Decided = tuple[Binding | None, Decision, Snapshot | None]


class PairingDesk:
    """The pairing rule's memory and the facts its decisions are made from."""

    def __init__(
        self,
        records: PodResourceRecords | None,
        specs: PodSpecBook | None,
        records_wait: float = RECORDS_WAIT,
    ) -> None:
        self.records = records
        self.specs = specs
        self.records_wait = records_wait
        self.pairing = Pairing()
        self._lock = threading.Lock()
        # GetPreferredAllocation's decision per resource, for the next Allocate (same binding)
        self._decided: dict[Resource, Decided] = {}

    def _read_records(self, resource: Resource, arrival: float) -> tuple[Snapshot | None, str]:
        """The kubelet's records as of after ``arrival``, when the pairing rule or (with pod
        specs) the placement hint will use them. Blocking I/O: never under the lock."""
        with self._lock:
            pairing = self.pairing.wants_records(resource, arrival)
        if not pairing and self.specs is None:
            return None, "not needed"
        if self.records is None:
            return None, "no PodResources socket configured"
        snapshot = self.records.read_after(arrival, timeout=self.records_wait)
        if snapshot is None:
            return None, f"PodResources: {self.records.last_error or 'no answer in time'}"
        return snapshot, ""

    def decide(
        self, resource: Resource, size: int, arrival: float, *, for_allocate: bool = False
    ) -> Decided:
        """Decide a request of ``size`` units of ``resource`` that arrived at ``arrival``;
        ``for_allocate``: kept for the Allocate that follows (GetPreferredAllocation)."""
        snapshot, missing = self._read_records(resource, arrival)
        specs = self.specs
        facts = Facts(
            snapshot,
            missing,
            specs.requests_of if specs is not None else None,
            specs.init_waiting if specs is not None else None,
        )
        with self._lock:
            last = self.pairing.last
        # Outside the lock: the spec lookups may re-read the pods from the API server.
        decision = decide(last, self.pairing.window, resource, size, arrival, facts)
        if decision.partner is not None and not decision.from_facts:
            log.info(
                "pairing_without_facts",
                resource=resource.value,
                steered_to=decision.partner.card,
                lacking=decision.lacking,
            )
        if for_allocate:
            with self._lock:
                self._decided[resource] = (last, decision, snapshot)
        return last, decision, snapshot

    def decided(self, resource: Resource, size: int, arrival: float) -> Decided:
        """An Allocate's decision: GetPreferredAllocation's, when it was made just before
        (nothing was bound since), else one made now."""
        with self._lock:
            seen, decision, snapshot = self._decided.pop(resource, (None, None, None))
            fresh = decision is not None and seen is self.pairing.last
        if fresh:
            assert decision is not None
            return seen, decision, snapshot
        return self.decide(resource, size, arrival)

    def bound(self, binding: Binding) -> None:
        """An Allocate's answer leaves: the binding the next request may pair with."""
        with self._lock:
            self.pairing.bound(binding)

    def refused(self) -> None:
        """An Allocate was refused: nothing the refused pod bound is anybody's partner."""
        with self._lock:
            self.pairing.refused()
            self._decided.clear()
