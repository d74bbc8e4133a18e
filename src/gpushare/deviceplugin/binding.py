"""Binding containers to cards: the plugin's decisions, free of gRPC.

:class:`Binder` answers the two questions the kubelet asks per container and
resource, "which units would you like?" (GetPreferredAllocation) and "bind these"
(Allocate), from the inventory, the usage ledger, card health and the placement
policy. It raises :class:`BindingError` for anything it must refuse; the servicer in
``plugin.py`` turns that into a gRPC status.

The invariant, enforced here and only here: a container never spans two cards.
Whether a request is the second resource of the container bound last is decided by
:class:`~gpushare.share.pairing.Pairing` from facts the binder gathers for it: the
kubelet's PodResources records, read after the request arrived (never an older
answer; the read is bounded by :data:`RECORDS_WAIT`), and the pod specs of the node.
A partner is steered to its partner's card and refused in Allocate anywhere else.
Without facts the same steering applies to the last binding of the other resource,
which can refuse but never split (docs/placement.md).

No lock is held across I/O: the records are read, and the cache directory created,
outside :attr:`Binder._lock`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

import structlog

from gpushare.gpu.health import HealthBoard
from gpushare.host.grantspecs import GrantSpecs, grant_name
from gpushare.host.library import prepare_cache_dir
from gpushare.host.mps import MpsError, MpsGrants
from gpushare.kube.podspecs import PodSpecBook, asking_tampering, holder_live
from gpushare.share import answers
from gpushare.share.answers import Answer, DeviceListing, Enforcement
from gpushare.share.devices import InvalidDeviceIds, Inventory, Resource, format_device_id
from gpushare.share.pairing import Binding, Decision, Facts, Pairing, decide
from gpushare.share.placement import (
    CandidateCard,
    Policy,
    Request,
    Room,
    choose_card,
    place_containers,
    plan_fits,
    preferred_units,
)
from gpushare.share.records import Snapshot
from gpushare.share.reserved import refusal as reserved_refusal
from gpushare.share.restartholders import RestartHolders
from gpushare.share.unitindex import UnitIndex
from gpushare.share.usage import Holder, UsageLedger

log = structlog.get_logger(__name__)

#: How long a request waits for the kubelet's records before deciding without them.
#: The kubelet waits for GetPreferredAllocation and Allocate without a deadline (v1.36
#: ``ManagerImpl.Allocate``: ``context.TODO()``), and a missing or refusing socket
#: answers at once, so only a kubelet that answers slowly is waited for; deciding
#: without its records pairs by the fallback, which refuses containers the records
#: would admit (issue 32.18: 0.2 s here refused 20 of 150 pods of ``make simulate``
#: with the extender when every ``List`` took 0.3 s).
RECORDS_WAIT = 5.0


class Refusal(enum.Enum):
    INVALID = "invalid argument"
    PRECONDITION = "failed precondition"
    INTERNAL = "internal"


class BindingError(Exception):
    def __init__(self, kind: Refusal, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def mixed_kinds(holder: Holder) -> str:
    """The refusal of a container that asks for shared units and whole cards or MIG."""
    return (
        f"container {holder.container} of pod {holder.namespace}/{holder.pod} asks for "
        "shared units (vcuda-memory/vcuda-core) together with whole cards or MIG devices; "
        "the answers would name different GPUs: split it into two containers"
    )


def grant_dirs(
    binder: Binder,
    resource: Resource,
    uuid: str,
    device_ids: list[str],
    units: int,
    partner: Binding | None,
) -> tuple[Path | None, Path | None]:
    """The host directories of one answer, made before it leaves: the interposer's cache
    directory (memory units it counts) and, on a card whose compute is MPS's, the
    container's namespace made and capped (fail closed: no cap, no answer), its pipe
    directory for a memory answer."""
    enforcement, memory = binder.enforcement, resource is Resource.MEMORY
    cache_dir = mps_pipe = None
    if memory and enforcement.interposer_counts_memory(uuid):
        try:
            cache_dir = prepare_cache_dir(binder.host_lib_dir, device_ids)
        except OSError as exc:
            raise BindingError(
                Refusal.INTERNAL, f"cannot create the container's cache directory: {exc}"
            ) from None
    mps = binder.mps
    if mps is None or not enforcement.by_mps(uuid):
        return cache_dir, None
    other = partner.device_ids if partner is not None else None
    try:
        if memory:
            mib = units * binder.inventory.memory_unit_mib
            pinned = enforcement.memory_soft(uuid)
            mps_pipe = mps.memory(device_ids, mib, pinned=pinned, partner_cores=other)
        else:
            mps.cores(device_ids, units, partner_memory=other)
    except (MpsError, OSError) as exc:
        raise BindingError(
            Refusal.INTERNAL, f"cannot cap the container's MPS namespace: {exc}"
        ) from None
    return cache_dir, mps_pipe


def core_without_memory(holder: Holder, prefix: str) -> str:
    """The refusal of a container that asks for cores and no memory units."""
    return (
        f"container {holder.container} of pod {holder.namespace}/{holder.pod} asks for "
        f"{Resource.CORE.name_with(prefix)} without {Resource.MEMORY.name_with(prefix)} "
        "(or with 0) and would run with no GPU memory limit on a shared card: add "
        f"{Resource.MEMORY.name_with(prefix)} of 1 or more to its limits"
    )


class PodResourceRecords(Protocol):
    """The kubelet's PodResources records (``podresources.PodResourcesClient``)."""

    last: Snapshot | None
    last_error: str

    def read_after(self, not_before: float, *, timeout: float) -> Snapshot | None:
        """A snapshot whose read began at or after ``not_before``; None if none in time."""
        ...


def other_free_in(
    inventory: Inventory,
    resource: Resource,
    free: Mapping[str, Sequence[int]],
    healthy: Sequence[str],
    snapshot: Snapshot,
    restart: RestartHolders | None = None,
    alive: Callable[[Holder], bool] | None = None,
) -> tuple[dict[str, int], set[str], dict[str, int]]:
    """Per card, the free units of the resource other than ``resource``, from the
    kubelet's records; the healthy cards on which the kubelet's offer of ``resource``
    (``free``, exact) shows holders the records do not list
    (:meth:`Snapshot.unlisted_on`); and for those cards, the most of the other resource
    that can be free there.

    What an unlisted holder has of the other resource is unknown, so it is taken as full
    there: the card is used only where no card the records vouch for can take the
    container (found by the e2e suite after a kubelet restart, e2e/README.md); the bound
    lets such a card be tried before cards known to be full. The offer and the records
    can also disagree the other way round: the offer is made before the request, the
    records read after it, and the kubelet's ``List`` frees the devices of pods that
    ended in between (issue 32.14: a restarted kubelet still killing deleted pods).

    A holder the records listed before a kubelet restart and not since (``restart``)
    still holds what it held: e.g. memory only, which the core offer cannot show (issue
    32.14); one these records list is counted by them already, one whose pod is gone
    or being deleted (``alive``, from the pod specs) holds nothing placement can use."""
    other = resource.other
    used = snapshot.used_counts[other]
    other_free = {
        uuid: card.units(other) - used.get(uuid, 0) for uuid, card in inventory.cards.items()
    }
    if restart is not None:
        for uuid, units in restart.held(other, snapshot.devices.keys(), alive).items():
            if uuid in other_free:
                other_free[uuid] = max(0, other_free[uuid] - units)
    # Only cards the offer names: one it leaves out entirely is full, or held back by
    # the Topology Manager (another NUMA node), and either way cannot take the request.
    taken = {
        uuid: inventory.cards[uuid].units(resource) - len(free[uuid])
        for uuid in healthy
        if free.get(uuid)
    }
    unlisted = snapshot.unlisted_on(resource, taken)
    at_most = {uuid: other_free[uuid] for uuid in unlisted}
    for uuid in unlisted:
        other_free[uuid] = 0
    return other_free, unlisted, at_most


def _sealed(
    grant: answers.Grant,
    listing: DeviceListing | None,
    specs: GrantSpecs | None,
    resource: Resource,
    device_ids: Sequence[str],
) -> Answer:
    """The grant's edits as the kubelet's answer: as they are, or, under a CDI strategy,
    riding on the grant's own CDI spec (``host/grantspecs.py``) no pod spec can change."""
    edits = answers.container_edits(grant, listing)
    if specs is None or listing is None or not listing.uses_cdi:
        return edits
    try:
        cdi_name = specs.write(grant_name(resource.value, device_ids), edits)
    except OSError as exc:
        raise BindingError(
            Refusal.INTERNAL, f"cannot write the grant's CDI spec in {specs.directory}: {exc}"
        ) from None
    return answers.sealed(edits, cdi_name, listing)


def _refuse_tampering(
    specs: PodSpecBook,
    resource: Resource,
    size: int,
    snapshot: Snapshot | None,
    decision: Decision,
    seen: Binding | None,
) -> None:
    """Refuse the container now asking if its own spec sets what carries its limits
    (``share/reserved.py``). The admission policy refuses such a pod; this is the second
    line where the policy is off (docs/security.md)."""
    holder = decision.holder
    if holder is None and snapshot is not None and seen is not None:
        holder = snapshot.holder_of(seen.resource, seen.device_ids[0])
    tamperer = asking_tampering(specs, resource, size, snapshot, holder)
    if tamperer is not None:
        who, why = tamperer
        log.warning("reserved_settings_refused", holder=str(who), reason=why)
        raise BindingError(
            Refusal.PRECONDITION, reserved_refusal(f"{who.pod}/{who.container}", why)
        )


class Binder:
    def __init__(
        self,
        inventory: Inventory,
        usage: UsageLedger,
        health: HealthBoard,
        *,
        policy: Policy | str,
        enforcement: Enforcement,
        host_lib_dir: Path,
        records: PodResourceRecords | None = None,
        specs: PodSpecBook | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_allocated: Callable[[Resource, str, Sequence[str]], None] | None = None,
        records_wait: float = RECORDS_WAIT,
        listing: DeviceListing | None = None,
        restart: RestartHolders | None = None,
        grant_specs: GrantSpecs | None = None,
        mps: MpsGrants | None = None,
    ) -> None:
        self.inventory = inventory
        self.restart = restart  # holders from before a kubelet restart (issue 32.14)
        self.usage = usage
        self.health = health
        self.policy = Policy.parse(policy)
        self.enforcement = enforcement
        self.listing = listing  # how answers name the card; None: the envvar alone
        self.grant_specs = grant_specs  # under a CDI strategy: the edits ride on these
        self.host_lib_dir = host_lib_dir
        self.records = records
        self.specs = specs
        self.records_wait = records_wait
        self._clock = clock
        self._on_allocated = on_allocated
        #: each container's MPS namespace on cards whose compute is MPS's (host/mps.py)
        self.mps = mps
        self._lock = threading.Lock()
        self.pairing = Pairing()
        # GetPreferredAllocation's decision per resource, for the next Allocate (same binding)
        self._decided: dict[Resource, tuple[Binding | None, Decision, Snapshot | None]] = {}
        self._units = UnitIndex(inventory)
        self._unlisted: set[str] = set()  # the cards last found to have unlisted holders

    def _group(self, resource: Resource, device_ids: Sequence[str]) -> dict[str, list[int]]:
        try:
            return self._units.group(resource, device_ids)
        except InvalidDeviceIds as exc:
            raise BindingError(Refusal.INVALID, str(exc)) from None

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

    def _decide(
        self, resource: Resource, size: int, arrival: float
    ) -> tuple[Binding | None, Decision, Snapshot | None]:
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
        return last, decision, snapshot

    def _note_unlisted(self, resource: Resource, unlisted: set[str]) -> None:
        if unlisted != self._unlisted:  # one line when the set changes
            self._unlisted = unlisted
            log.info(
                "records_miss_holders",
                resource=resource.value,
                gpus=sorted(unlisted),
                detail="the kubelet holds units the PodResources records list no "
                "container for; placement takes the other resource of these cards as full",
            )

    def _describe(self, uuid: str) -> str:
        card = self.inventory.cards[uuid]
        return f"GPU{card.gpu.index} ({uuid})"

    # -- GetPreferredAllocation ------------------------------------------------------
    def preferred(
        self,
        resource: Resource,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        allowed: Callable[[str], bool] | None = None,
    ) -> list[str]:
        """``allowed``: cards the asking pod accepts (its use-gputype annotations)."""
        arrival = self._clock()
        if size <= 0:
            raise BindingError(Refusal.INVALID, f"allocation_size must be positive, got {size}")
        if size > len(available):
            raise BindingError(
                Refusal.INVALID,
                f"allocation_size {size} exceeds the {len(available)} available devices",
            )
        free = self._group(resource, available)
        required = self._group(resource, must_include)
        for uuid, numbers in required.items():
            if not set(numbers) <= set(free.get(uuid, ())):
                raise BindingError(
                    Refusal.INVALID, "must_include_deviceIDs are not all in available_deviceIDs"
                )
        # The board may hold cards that are not this binder's (a card in DRA mode beside
        # shared ones, without whole cards, shares the cards' own board).
        healthy = [u for u in self.health.healthy_cards() if u in self.inventory.cards]
        self.usage.observe_available(resource, free, healthy)
        last, decision, snapshot = self._decide(resource, size, arrival)
        with self._lock:
            self._decided[resource] = (last, decision, snapshot)
        if snapshot is not None:  # the kubelet's records as of now: exact, unless...
            alive = partial(holder_live, self.specs) if self.specs is not None else None
            args = (self.inventory, resource, free, healthy, snapshot, self.restart, alive)
            other_free, unlisted, at_most = other_free_in(*args)
            self._note_unlisted(resource, unlisted)
        else:  # the last offer of the other resource and every Allocate since
            other_free, at_most = self.usage.free_counts(resource.other), {}
        cards = [
            CandidateCard(
                uuid=uuid,
                index=card.gpu.index,
                free_units=tuple(sorted(free.get(uuid, ()))),
                memory_free=len(free.get(uuid, ()))
                if resource is Resource.MEMORY
                else other_free[uuid],
                core_free=len(free.get(uuid, ()))
                if resource is Resource.CORE
                else other_free[uuid],
                healthy=self.health.is_healthy(uuid) and (allowed is None or allowed(uuid)),
                other_at_most=at_most.get(uuid),
            )
            for uuid, card in self.inventory.cards.items()
        ]
        prefer, other_need = None, None
        if decision.partner is None and self.specs is not None:
            holder = decision.holder
            if holder is None and snapshot is not None and last is not None:
                # Whatever resource it was, the container bound last tells which pod is
                # being admitted, and so which of its containers comes next.
                holder = snapshot.holder_of(last.resource, last.device_ids[0])
            needs, planned = self.specs.asking_planned(resource, size, snapshot, holder)
            if needs:
                other_need = needs[0].of(resource.other)
                rooms = [
                    Room(c.uuid, c.index, c.memory_free, c.core_free, c.healthy) for c in cards
                ]
                # The extender's plan first (it counted the pod there, whatever order
                # the kubelet admits the pods bound since in), else the policy's.
                plan = next((p for p in planned if plan_fits(rooms, needs, p)), None)
                plan = plan or place_containers(rooms, needs, self.policy)
                prefer = plan[0] if plan else None
        request = Request(
            resource=resource,
            size=size,
            must_include=required,
            partner=decision.partner.card if decision.partner else None,
            prefer=prefer,
            other_need=other_need,
        )
        chosen = choose_card(cards, request, self.policy)
        if chosen is None:
            return []
        return [format_device_id(chosen.uuid, n) for n in preferred_units(chosen, request)]

    # -- Allocate --------------------------------------------------------------------
    def allocate(self, resource: Resource, device_ids: Sequence[str]) -> tuple[str, Answer]:
        """Bind one container's units of ``resource``; returns the card and the answer.

        Any refusal fails the pod's admission in the kubelet, so after one nothing the
        pod bound before is anybody's partner.
        """
        try:
            return self._allocate(resource, device_ids)
        except BindingError:
            self.refused()
            raise

    def refused(self) -> None:
        """An Allocate of this node was refused (here or by the caller's own checks):
        the kubelet rejects that pod, so nothing it bound is anybody's partner."""
        with self._lock:
            self.pairing.refused()
            self._decided.clear()

    def _allocate(self, resource: Resource, device_ids: Sequence[str]) -> tuple[str, Answer]:
        arrival = self._clock()
        if not device_ids:
            raise BindingError(Refusal.INVALID, "the request names no devices")
        grouped = self._group(resource, device_ids)
        if len(grouped) > 1:
            cards = ", ".join(f"{self._describe(u)}: {len(n)} units" for u, n in grouped.items())
            raise BindingError(
                Refusal.PRECONDITION,
                f"a container must stay on one GPU, but its {resource.value} units span "
                f"{len(grouped)}: {cards}; no single card had {len(device_ids)} free units",
            )
        ((uuid, numbers),) = grouped.items()
        if not self.health.is_healthy(uuid):
            reason = self.health.reason(uuid) or "unhealthy"
            raise BindingError(
                Refusal.PRECONDITION, f"{self._describe(uuid)} is unhealthy ({reason})"
            )
        with self._lock:
            seen, decision, snapshot = self._decided.pop(resource, (None, None, None))
            fresh = decision is not None and seen is self.pairing.last
        if not fresh:  # no GetPreferredAllocation just before: decide now
            seen, decision, snapshot = self._decide(resource, len(device_ids), arrival)
        assert decision is not None
        if snapshot is not None and self.specs is not None:
            mixer = self.specs.mixer_being_admitted(snapshot, shared=resource)
            if mixer is not None:
                raise BindingError(Refusal.PRECONDITION, mixed_kinds(mixer))
        if resource is Resource.CORE and decision.partner is None and self.specs is not None:
            # Not the second half of a memory binding: a container of its own. If its
            # spec asks no memory units, it would run with the whole card's memory.
            holder = decision.holder
            if holder is None and snapshot is not None and seen is not None:
                holder = snapshot.holder_of(seen.resource, seen.device_ids[0])
            asker = self.specs.asking_without_memory(len(device_ids), snapshot, holder)
            if asker is not None:
                message = core_without_memory(asker, self.specs.prefix)
                raise BindingError(Refusal.PRECONDITION, message)
        if decision.partner is None and self.specs is not None:  # its partner was checked
            _refuse_tampering(self.specs, resource, len(device_ids), snapshot, decision, seen)
        with self._lock:
            partner = decision.partner
            if partner is not None and partner.card != uuid:
                refusal = (
                    f"this container's {partner.resource.value} units were just bound to "
                    f"{self._describe(partner.card)}, but its {resource.value} units are on "
                    f"{self._describe(uuid)}: no single card holds both requests"
                )
            else:
                refusal = None
        if refusal is not None:
            log.warning(
                "pairing_refused",
                resource=resource.value,
                gpu=uuid,
                partner_gpu=partner.card if partner else None,
                basis=decision.basis.name.lower(),
                holder=str(decision.holder) if decision.holder else None,
                lacking=decision.lacking,
            )
            raise BindingError(Refusal.PRECONDITION, refusal)
        units = len(numbers)
        cache_dir, mps_pipe = grant_dirs(self, resource, uuid, list(device_ids), units, partner)
        grant = answers.share(
            uuid,
            enforcement=self.enforcement,
            memory_mib=units * self.inventory.memory_unit_mib
            if resource is Resource.MEMORY
            else None,
            cores=units if resource is Resource.CORE else None,
            cache_dir=cache_dir,
            mps_pipe=mps_pipe,
        )
        answer = _sealed(grant, self.listing, self.grant_specs, resource, device_ids)
        self.usage.record_allocation(resource, uuid, numbers)
        if self._on_allocated is not None:
            self._on_allocated(resource, uuid, device_ids)
        with self._lock:
            # Timed as the answer leaves: the kubelet asks for the container's next
            # resource right after it (the window only matters when facts are missing).
            self.pairing.bound(Binding(resource, uuid, tuple(device_ids), self._clock()))
        log.info(
            "allocated",
            resource=resource.value,
            gpu=uuid,
            index=self.inventory.cards[uuid].gpu.index,
            units=len(numbers),
            paired=partner is not None,
            basis=decision.basis.name.lower(),
        )
        return uuid, answer
