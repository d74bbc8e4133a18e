"""Binding containers to cards: the plugin's decisions, free of gRPC.

:class:`Binder` answers the two questions the kubelet asks per container and
resource, "which units would you like?" (GetPreferredAllocation) and "bind these"
(Allocate), from the inventory, the usage ledger, card health and the placement
policy. It raises :class:`BindingError` for anything it must refuse; the servicer in
``plugin.py`` turns that into a gRPC status.

The invariant, enforced here and only here: a container never spans two cards.
Whether a request is the second resource of the container bound last is decided by
:func:`~gpushare.share.pairing.decide` from facts the binder's
:class:`~gpushare.deviceplugin.pairingdesk.PairingDesk` gathers for it: the kubelet's
PodResources records, read after the request arrived (never an older answer; the read
is bounded by :data:`RECORDS_WAIT`), and the pod specs of the node. A partner is
steered to its partner's card and refused in Allocate anywhere else. Without facts the
same steering applies to the last binding of the other resource, which can refuse but
never split (docs/placement.md).

An Allocate is decided first (``Binder._plan``: every refusal, then
:func:`~gpushare.deviceplugin.shareplan.plan_share`, pure: the grant, its host side and
its edits) and applied after (``Binder._apply``: the host side made and the grant's CDI
spec written by :class:`~gpushare.host.grants.GrantHost`, the units recorded, the
pairing told). No lock is held across I/O: the records are read, and the cache
directory created, outside the desk's lock.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path

import structlog

from gpushare.deviceplugin.pairingdesk import RECORDS_WAIT as RECORDS_WAIT
from gpushare.deviceplugin.pairingdesk import PairingDesk, PodResourceRecords
from gpushare.deviceplugin.shareplan import SharePlan, partner_refusal, plan_share, span_refusal
from gpushare.gpu.health import HealthBoard, unhealthy
from gpushare.host.grants import GrantHost, HostGrantError
from gpushare.host.grantspecs import GrantSpecs
from gpushare.host.mps import MpsGrants
from gpushare.kube.podspecs import PodSpecBook, holder_live
from gpushare.kube.specrefusals import spec_refusal
from gpushare.share.answers import ContainerEdits, DeviceListing, Enforcement
from gpushare.share.devices import InvalidDeviceIds, Inventory, Resource, format_device_id
from gpushare.share.pairing import Binding, Decision
from gpushare.share.placement import (
    CandidateCard,
    Need,
    Policy,
    Request,
    Room,
    choose_card,
    place_containers,
    plan_fits,
    preferred_units,
)
from gpushare.share.records import Snapshot
from gpushare.share.restartholders import RestartHolders
from gpushare.share.unitindex import UnitIndex
from gpushare.share.usage import Holder, UsageLedger

log = structlog.get_logger(__name__)



class Refusal(enum.Enum):
    INVALID = "invalid argument"
    PRECONDITION = "failed precondition"
    INTERNAL = "internal"


class BindingError(Exception):
    def __init__(self, kind: Refusal, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


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


def candidate_cards(
    inventory: Inventory,
    resource: Resource,
    free: Mapping[str, Sequence[int]],
    other_free: Mapping[str, int],
    at_most: Mapping[str, int],
    usable: Callable[[str], bool],
) -> list[CandidateCard]:
    """Every card as placement weighs it for a request of ``resource``: its free units
    of ``resource`` (the kubelet's offer), of the other resource (``other_free``; at most
    ``at_most`` where the records miss holders), and whether it may take the request."""
    return [
        CandidateCard(
            uuid=uuid,
            index=card.gpu.index,
            free_units=tuple(sorted(free.get(uuid, ()))),
            memory_free=len(free.get(uuid, ()))
            if resource is Resource.MEMORY
            else other_free[uuid],
            core_free=len(free.get(uuid, ())) if resource is Resource.CORE else other_free[uuid],
            healthy=usable(uuid),
            other_at_most=at_most.get(uuid),
        )
        for uuid, card in inventory.cards.items()
    ]


def pod_plan_card(
    cards: Sequence[CandidateCard],
    needs: Sequence[Need],
    planned: Iterable[Sequence[str]],
    policy: Policy,
) -> str | None:
    """The card the pod's containers still to come (``needs``, this one first) should
    start on: the extender's plan first, where it still fits (it counted the pod there,
    whatever order the kubelet admits the pods bound since in), else the policy's."""
    rooms = [Room(c.uuid, c.index, c.memory_free, c.core_free, c.healthy) for c in cards]
    plan = next((p for p in planned if plan_fits(rooms, needs, p)), None)
    plan = plan or place_containers(rooms, needs, policy)
    return plan[0] if plan else None


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
        #: the grants' host side: cache directories, MPS namespaces (each container's on
        #: cards whose compute is MPS's), and under a CDI strategy the grant's own spec
        self.host = GrantHost.of(host_lib_dir, mps=mps, specs=grant_specs, listing=listing)
        self.specs = specs
        self._clock = clock
        self._on_allocated = on_allocated
        #: the pairing rule's memory and the facts of its decisions (records, pod specs)
        self.desk = PairingDesk(records, specs, records_wait)
        self._units = UnitIndex(inventory)
        self._unlisted: set[str] = set()  # the cards last found to have unlisted holders

    @property
    def records_wait(self) -> float:
        """How long a request waits for the kubelet's records (:data:`RECORDS_WAIT`)."""
        return self.desk.records_wait

    @records_wait.setter
    def records_wait(self, seconds: float) -> None:
        self.desk.records_wait = seconds

    def _group(self, resource: Resource, device_ids: Sequence[str]) -> dict[str, list[int]]:
        try:
            return self._units.group(resource, device_ids)
        except InvalidDeviceIds as exc:
            raise BindingError(Refusal.INVALID, str(exc)) from None

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
        free, required = self._offer(resource, available, must_include, size)
        # The board may hold cards that are not this binder's (a card in DRA mode beside
        # shared ones, without whole cards, shares the cards' own board).
        healthy = [u for u in self.health.healthy_cards() if u in self.inventory.cards]
        self.usage.observe_available(resource, free, healthy)
        last, decision, snapshot = self.desk.decide(resource, size, arrival, for_allocate=True)
        if snapshot is not None:  # the kubelet's records as of now: exact, unless...
            alive = partial(holder_live, self.specs) if self.specs is not None else None
            args = (self.inventory, resource, free, healthy, snapshot, self.restart, alive)
            other_free, unlisted, at_most = other_free_in(*args)
            self._note_unlisted(resource, unlisted)
        else:  # the last offer of the other resource and every Allocate since
            other_free, at_most = self.usage.free_counts(resource.other), {}

        def usable(uuid: str) -> bool:
            return self.health.is_healthy(uuid) and (allowed is None or allowed(uuid))

        cards = candidate_cards(self.inventory, resource, free, other_free, at_most, usable)
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
                prefer = pod_plan_card(cards, needs, planned, self.policy)
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

    def _offer(
        self, resource: Resource, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """The kubelet's offer checked: its free units per card, and the required ones."""
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
        return free, required

    # -- Allocate --------------------------------------------------------------------
    def allocate(self, resource: Resource, device_ids: Sequence[str]) -> tuple[str, ContainerEdits]:
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
        self.desk.refused()

    def _allocate(
        self, resource: Resource, device_ids: Sequence[str]
    ) -> tuple[str, ContainerEdits]:
        plan, decision = self._plan(resource, device_ids)
        return plan.uuid, self._apply(plan, decision)

    # -- Allocate: the decision ------------------------------------------------------
    def _plan(
        self, resource: Resource, device_ids: Sequence[str]
    ) -> tuple[SharePlan, Decision]:
        """What this Allocate grants, or the BindingError that refuses it; nothing is
        made here (the records and pod specs may be read: facts, not side effects)."""
        arrival = self._clock()
        uuid, numbers = self._one_card(resource, device_ids)
        seen, decision, snapshot = self.desk.decided(resource, len(device_ids), arrival)
        if self.specs is not None:
            refusal = spec_refusal(self.specs, resource, len(device_ids), snapshot, decision, seen)
            if refusal is not None:
                raise BindingError(Refusal.PRECONDITION, refusal)
        partner = decision.partner
        refusal = partner_refusal(resource, uuid, partner, self._describe)
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
        plan = plan_share(
            resource,
            uuid,
            numbers,
            device_ids,
            enforcement=self.enforcement,
            unit_mib=self.inventory.memory_unit_mib,
            dirs=self.host.plan_dirs(),
            mps=self.host.mps is not None,
            listing=self.listing,
            partner=partner,
        )
        return plan, decision

    def _one_card(self, resource: Resource, device_ids: Sequence[str]) -> tuple[str, list[int]]:
        """The one healthy card the units are on, and their numbers there."""
        if not device_ids:
            raise BindingError(Refusal.INVALID, "the request names no devices")
        grouped = self._group(resource, device_ids)
        refusal = span_refusal(resource, grouped, len(device_ids), self._describe)
        if refusal is not None:
            raise BindingError(Refusal.PRECONDITION, refusal)
        ((uuid, numbers),) = grouped.items()
        reason = unhealthy(self.health, (uuid,))
        if reason is not None:
            raise BindingError(
                Refusal.PRECONDITION, f"{self._describe(uuid)} is unhealthy ({reason})"
            )
        return uuid, numbers

    # -- Allocate: the apply step ----------------------------------------------------
    def _apply(self, plan: SharePlan, decision: Decision) -> ContainerEdits:
        """Make the plan's host side, seal its edits (a CDI strategy: the grant's own
        spec), record the units and tell the pairing; the kubelet's answer."""
        try:
            self.host.make(plan.needs)
            answer = self.host.seal(plan.edits, plan.spec_name)
        except HostGrantError as exc:
            raise BindingError(Refusal.INTERNAL, str(exc)) from None
        uuid, device_ids = plan.uuid, plan.device_ids
        self.usage.record_allocation(plan.resource, uuid, list(plan.numbers))
        if self._on_allocated is not None:
            self._on_allocated(plan.resource, uuid, device_ids)
        # Timed as the answer leaves: the kubelet asks for the container's next
        # resource right after it (the window only matters when facts are missing).
        self.desk.bound(Binding(plan.resource, uuid, device_ids, self._clock()))
        log.info(
            "allocated",
            resource=plan.resource.value,
            gpu=uuid,
            index=self.inventory.cards[uuid].gpu.index,
            units=len(plan.numbers),
            paired=decision.partner is not None,
            basis=decision.basis.name.lower(),
        )
        return answer
