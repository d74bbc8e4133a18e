"""The pairing desk (``deviceplugin/pairingdesk.py``): the binder's memory of the
binding made last and the facts each pairing decision is made from.

What it proves: every decision is :func:`gpushare.share.pairing.decide` over the
binding made last and the facts the desk gathered; the kubelet's records are read only
when the rule or the pod specs will use them, after the request arrived and bounded by
the desk's wait, never under the desk's lock; why records are missing is said in the
decision; GetPreferredAllocation's decision is the Allocate's only while nothing was
bound since; a refusal forgets the binding and every kept decision.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from kit.sizes import at_two_sizes
from structlog.testing import capture_logs

from gpushare.deviceplugin.pairingdesk import RECORDS_WAIT, PairingDesk
from gpushare.kube.podspecs import PodSpecBook
from gpushare.share.devices import Resource, format_device_id
from gpushare.share.pairing import PAIR_WINDOW, Basis, Binding, Facts, decide
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder

PREFIX = "gpushare.io"
CARDS = ("GPU-aaaa", "GPU-bbbb")
HOLDER = Holder("t", "p", "main")


@dataclass
class KubeletRecords:
    """The kubelet's PodResources records at the edge: one canned answer (None: no
    answer in time), and every read asked of it."""

    answer: Snapshot | None
    last_error: str = ""
    last: Snapshot | None = None
    reads: list[tuple[float, float]] = field(default_factory=list)

    def read_after(self, not_before: float, *, timeout: float) -> Snapshot | None:
        self.reads.append((not_before, timeout))
        return self.answer


def binding(resource: Resource, card: str, n: int, at: float) -> Binding:
    return Binding(resource, card, (format_device_id(card, n),), at)


def holding(*held: tuple[Resource, str, int]) -> Snapshot:
    """Records in which HOLDER holds these units."""
    snap = Snapshot(0.0)
    for resource, card, n in held:
        device = format_device_id(card, n)
        snap.holders[(resource, device)] = HOLDER
        snap.devices.setdefault(HOLDER, {}).setdefault(resource, []).append(device)
    return snap


def book(memory: int, core: int) -> PodSpecBook:
    specs = PodSpecBook(PREFIX)
    limits = {f"{PREFIX}/vcuda-memory": str(memory), f"{PREFIX}/vcuda-core": str(core)}
    specs.update({
        "metadata": {"uid": "u", "namespace": HOLDER.namespace, "name": HOLDER.pod},
        "spec": {"containers": [{"name": HOLDER.container, "resources": {"limits": limits}}]},
        "status": {"phase": "Pending"},
    })  # fmt: skip
    return specs


# -- the desk against a model of its rule ---------------------------------------------

resources = st.sampled_from(list(Resource))
times = st.floats(min_value=0.0, max_value=3 * PAIR_WINDOW, allow_nan=False)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("bound"), resources, st.sampled_from(CARDS), st.integers(0, 1), times),
        st.tuples(st.just("refused")),
        st.tuples(st.just("decide"), resources, st.integers(1, 2), times, st.booleans()),
        st.tuples(st.just("decided"), resources, st.integers(1, 2), times),
    ),
    max_size=12,
)
snapshots = st.lists(
    st.tuples(resources, st.sampled_from(CARDS), st.integers(0, 1)), max_size=3
).map(lambda held: holding(*held))
# no socket; a socket that answers nothing in time (with or without a reason); records
records_kinds = st.one_of(
    st.none(),
    st.builds(KubeletRecords, st.none(), st.sampled_from(["", "connection refused"])),
    st.builds(KubeletRecords, snapshots),
)
spec_books = st.one_of(st.none(), st.builds(book, st.integers(0, 2), st.integers(0, 2)))


@at_two_sizes(given(records_kinds, spec_books, operations), quick=150, full=1500, deadline=None)
def test_every_decision_is_the_rule_over_the_facts_the_desk_gathered(
    records: KubeletRecords | None, specs: PodSpecBook | None, ops: list[tuple]
) -> None:
    desk = PairingDesk(records, specs, records_wait=2.5)
    last: Binding | None = None
    kept: dict[Resource, tuple] = {}

    def expected(resource: Resource, size: int, arrival: float) -> tuple:
        """What the desk must answer, and the read it must make (None: none)."""
        wants = last is not None and last.resource is not resource
        wants = wants and arrival - last.at <= desk.pairing.window  # type: ignore[union-attr]
        read = None
        if not wants and specs is None:
            snapshot, missing = None, "not needed"
        elif records is None:
            snapshot, missing = None, "no PodResources socket configured"
        else:
            read = (arrival, 2.5)
            snapshot = records.answer
            why = records.last_error or "no answer in time"
            missing = "" if snapshot is not None else f"PodResources: {why}"
        facts = Facts(
            snapshot,
            missing,
            specs.requests_of if specs is not None else None,
            specs.init_waiting if specs is not None else None,
        )
        decision = decide(last, desk.pairing.window, resource, size, arrival, facts)
        return (last, decision, snapshot), read

    for op in ops:
        reads_before = len(records.reads) if records is not None else 0
        if op[0] == "bound":
            _, resource, card, n, at = op
            last = binding(resource, card, n, at)
            desk.bound(last)
            assert desk.pairing.last is last
            continue
        if op[0] == "refused":
            desk.refused()
            last, kept = None, {}
            assert desk.pairing.last is None
            continue
        _, resource, size, arrival, *rest = op
        held = kept.pop(resource, None) if op[0] == "decided" else None
        if held is not None and held[0] is last:  # GetPreferredAllocation's, unchanged
            want, read = held, None
        else:
            want, read = expected(resource, size, arrival)
        got = (
            desk.decided(resource, size, arrival)
            if op[0] == "decided"
            else desk.decide(resource, size, arrival, for_allocate=rest[0])
        )
        assert got[0] is want[0] and got[1:] == want[1:]
        if op[0] == "decide" and rest[0]:
            kept[resource] = got
        reads = records.reads[reads_before:] if records is not None else []
        assert reads == ([read] if read is not None else [])


# -- what the decisions say -----------------------------------------------------------


def test_without_records_the_other_resource_in_the_window_is_steered_to_the_last_card() -> None:
    desk = PairingDesk(None, None)
    memory = binding(Resource.MEMORY, CARDS[1], 0, at=100.0)
    desk.bound(memory)
    with capture_logs() as logs:
        seen, decision, snapshot = desk.decide(Resource.CORE, 30, 100.0 + PAIR_WINDOW / 2)
    assert seen is memory and snapshot is None
    assert decision.basis is Basis.FALLBACK and decision.partner is memory
    assert decision.lacking == "no PodResources socket configured"
    steered = [e for e in logs if e["event"] == "pairing_without_facts"]
    assert [(e["resource"], e["steered_to"]) for e in steered] == [("vcuda-core", CARDS[1])]
    # the same resource again is nobody's partner, whatever the time
    assert desk.decide(Resource.MEMORY, 4, 100.0)[1].basis is Basis.NOTHING_TO_PAIR
    # past the window, facts missing: nobody's partner either
    late = desk.decide(Resource.CORE, 30, 100.0 + PAIR_WINDOW * 2)[1]
    assert late.basis is Basis.EXPIRED and late.partner is None


def test_records_that_do_not_come_say_why_in_the_decision() -> None:
    refused = KubeletRecords(None, last_error="connection refused")
    desk = PairingDesk(refused, None)
    desk.bound(binding(Resource.MEMORY, CARDS[0], 0, at=0.0))
    assert desk.decide(Resource.CORE, 1, 1.0)[1].lacking == "PodResources: connection refused"
    assert refused.reads == [(1.0, RECORDS_WAIT)]  # after the arrival, bounded by the wait
    slow = KubeletRecords(None)
    desk = PairingDesk(slow, None, records_wait=0.25)
    desk.bound(binding(Resource.MEMORY, CARDS[0], 0, at=0.0))
    assert desk.decide(Resource.CORE, 1, 2.0)[1].lacking == "PodResources: no answer in time"
    assert slow.reads == [(2.0, 0.25)]


def test_records_and_a_spec_make_the_partner_a_fact() -> None:
    memory = binding(Resource.MEMORY, CARDS[0], 0, at=0.0)
    desk = PairingDesk(KubeletRecords(holding((Resource.MEMORY, CARDS[0], 0))), book(1, 30))
    desk.bound(memory)
    _, decision, _ = desk.decide(Resource.CORE, 30, 1.0)
    assert (decision.basis, decision.partner, decision.holder) == (Basis.PARTNER, memory, HOLDER)
    _, other, _ = desk.decide(Resource.CORE, 20, 1.0)  # not the size the spec asks
    assert other.basis is Basis.FALLBACK and other.from_facts is False


def test_nothing_to_pair_and_no_specs_reads_no_records() -> None:
    records = KubeletRecords(Snapshot(0.0))
    desk = PairingDesk(records, None)
    assert desk.decide(Resource.MEMORY, 4, 0.0)[1].basis is Basis.NOTHING_TO_PAIR
    desk.bound(binding(Resource.MEMORY, CARDS[0], 0, at=0.0))
    desk.decide(Resource.MEMORY, 4, 1.0)  # the same resource: the rule needs no records
    assert records.reads == []
    # with pod specs the placement hint uses the records: read even with nothing to pair
    with_specs = PairingDesk(records, book(1, 0))
    with_specs.decide(Resource.MEMORY, 1, 3.0)
    assert records.reads == [(3.0, RECORDS_WAIT)]


def test_an_allocate_reuses_the_preferred_decision_only_while_nothing_was_bound() -> None:
    records = KubeletRecords(None)
    desk = PairingDesk(records, None)
    desk.bound(binding(Resource.MEMORY, CARDS[0], 0, at=0.0))
    preferred = desk.decide(Resource.CORE, 1, 1.0, for_allocate=True)
    reused = desk.decided(Resource.CORE, 1, 1.5)
    assert all(got is kept for got, kept in zip(reused, preferred, strict=True))
    assert len(records.reads) == 1  # the Allocate read nothing again
    # used once: the next Allocate decides afresh
    again = desk.decided(Resource.CORE, 1, 1.5)
    assert again[1] is not preferred[1] and len(records.reads) == 2
    # a binding between the two: the kept decision is stale
    desk.decide(Resource.CORE, 1, 2.0, for_allocate=True)
    newer = binding(Resource.MEMORY, CARDS[1], 0, at=2.5)
    desk.bound(newer)
    assert desk.decided(Resource.CORE, 1, 3.0)[1].partner is newer
    # a refusal forgets the binding and what was kept
    desk.decide(Resource.CORE, 1, 3.0, for_allocate=True)
    desk.refused()
    assert desk.pairing.last is None
    assert desk.decided(Resource.CORE, 1, 3.5)[1].basis is Basis.NOTHING_TO_PAIR
    # even a decision kept with nothing to pair is not the next pod's: records read anew
    with_specs = KubeletRecords(Snapshot(0.0))
    desk = PairingDesk(with_specs, book(1, 1))
    desk.decide(Resource.MEMORY, 1, 4.0, for_allocate=True)
    desk.refused()
    desk.decided(Resource.MEMORY, 1, 5.0)
    assert with_specs.reads == [(4.0, RECORDS_WAIT), (5.0, RECORDS_WAIT)]


def test_the_records_are_read_outside_the_desks_lock() -> None:
    """Another request's binding (a call that takes the lock) goes through while a
    read of the records is under way."""
    finished: list[bool] = []

    class ReadingRecords(KubeletRecords):
        def read_after(self, not_before: float, *, timeout: float) -> Snapshot | None:
            def bind_meanwhile() -> None:
                desk.bound(binding(Resource.CORE, CARDS[1], 0, 9.0))
                finished.append(True)

            other = threading.Thread(target=bind_meanwhile)
            other.start()
            other.join(timeout=30)
            return super().read_after(not_before, timeout=timeout)

    desk = PairingDesk(ReadingRecords(None), None)
    desk.bound(binding(Resource.MEMORY, CARDS[0], 0, at=0.0))
    desk.decide(Resource.CORE, 1, 1.0)
    assert finished == [True]
    assert desk.pairing.last is not None and desk.pairing.last.resource is Resource.CORE


@settings(max_examples=50, deadline=None)
@given(st.floats(min_value=0.0, max_value=100.0), st.floats(min_value=0.0, max_value=100.0))
def test_the_records_read_never_begins_before_the_request_arrived(
    bound_at: float, arrival: float
) -> None:
    records = KubeletRecords(Snapshot(0.0))
    desk = PairingDesk(records, book(1, 1))
    desk.bound(binding(Resource.MEMORY, CARDS[0], 0, at=bound_at))
    desk.decide(Resource.CORE, 1, arrival)
    assert records.reads == [(arrival, RECORDS_WAIT)]
