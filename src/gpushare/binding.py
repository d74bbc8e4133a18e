"""Binding containers to cards: the plugin's decisions, free of gRPC.

:class:`Binder` answers the two questions the kubelet asks per container and
resource, "which units would you like?" (GetPreferredAllocation) and "bind these"
(Allocate), from the inventory, the usage ledger, card health and the placement
policy. It raises :class:`BindingError` for anything it must refuse; the servicer in
``plugin.py`` turns that into a gRPC status.

Pairing (docs/placement.md): after Allocate binds one resource of a container to a
card, the container's other resource, asked for right after, must land on the same
card. The binder remembers the last binding for a short window (:data:`PAIR_WINDOW`)
and decides whether the request in hand is that binding's partner:

* the kubelet's records (PodResources) name the container holding the last binding;
  if it already holds this resource too, it is complete and there is no partner;
* if that container's pod spec is known, it says whether it wants this resource;
* otherwise the last binding is taken as the partner, unless it itself completed a
  pair.

A request with a partner is steered to the partner's card, and refused in Allocate
if it lands elsewhere: a container never spans two cards.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from gpushare.answers import Answer, Enforcement, build_answer
from gpushare.devices import InvalidDeviceIds, Inventory, Resource, format_device_id
from gpushare.health import HealthBoard
from gpushare.library import prepare_cache_dir
from gpushare.placement import CardView, Request, choose_card, preferred_units
from gpushare.podresources import Snapshot
from gpushare.usage import Holder, UsageLedger

log = structlog.get_logger(__name__)

#: The kubelet asks for a container's two resources back to back, within milliseconds.
PAIR_WINDOW = 5.0


class Refusal(enum.Enum):
    INVALID = "invalid argument"
    PRECONDITION = "failed precondition"
    INTERNAL = "internal"


class BindingError(Exception):
    def __init__(self, kind: Refusal, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class PodSpecs(Protocol):
    """What the pod specs on this node ask for (learned from the API server)."""

    def requests_of(self, holder: Holder) -> dict[Resource, int] | None:
        """Units of each resource the container asks for; None if unknown."""
        ...

    def other_need(self, resource: Resource, size: int, snapshot: Snapshot | None) -> int | None:
        """Units of ``resource.other`` wanted by the container now asking ``size`` of
        ``resource``: 0 if it wants none, None if that cannot be told."""
        ...


@dataclass(frozen=True)
class _Binding:
    resource: Resource
    uuid: str
    first_id: str
    at: float
    completed_pair: bool


class Binder:
    def __init__(
        self,
        inventory: Inventory,
        usage: UsageLedger,
        health: HealthBoard,
        *,
        policy: str,
        enforcement: Enforcement,
        host_lib_dir: Path,
        records: Callable[[], Snapshot | None] | None = None,
        specs: PodSpecs | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_allocated: Callable[[Resource, str, Sequence[str]], None] | None = None,
    ) -> None:
        self.inventory = inventory
        self.usage = usage
        self.health = health
        self.policy = policy
        self.enforcement = enforcement
        self.host_lib_dir = host_lib_dir
        self.records = records
        self.specs = specs
        self._clock = clock
        self._on_allocated = on_allocated
        self._lock = threading.Lock()
        self._last: _Binding | None = None
        # The partner decided in GetPreferredAllocation, reused by the Allocate after it.
        self._decided: dict[Resource, tuple[_Binding | None, _Binding | None]] = {}
        # Precomputed ID -> (card, unit) for both resources: parsing tens of thousands
        # of IDs per request would dominate the request's cost.
        self._index: dict[Resource, dict[str, tuple[str, int]]] = {
            resource: {
                format_device_id(card.uuid, n): (card.uuid, n)
                for card in inventory.cards.values()
                for n in range(card.units(resource))
            }
            for resource in Resource
        }

    # -- shared helpers -----------------------------------------------------------
    def _group(self, resource: Resource, device_ids: Sequence[str]) -> dict[str, list[int]]:
        # One Python string per ID (a protobuf field makes a new one on every access),
        # so each is hashed once: by the lookups, then reused by the duplicate check.
        ids = list(device_ids)
        try:
            located = list(map(self._index[resource].__getitem__, ids))
        except (KeyError, TypeError):
            # Slow path, only to explain what is wrong (and catch duplicates below).
            try:
                self.inventory.resolve(resource, ids)
            except InvalidDeviceIds as exc:
                raise BindingError(Refusal.INVALID, str(exc)) from None
            raise BindingError(Refusal.INVALID, "unknown device ID") from None
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            twice = next(d for d in ids if d in seen or seen.add(d))  # type: ignore[func-returns-value]
            raise BindingError(Refusal.INVALID, f"{twice!r} is listed twice")
        grouped: dict[str, list[int]] = {}
        for uuid, n in located:
            numbers = grouped.get(uuid)
            if numbers is None:
                grouped[uuid] = numbers = []
            numbers.append(n)
        return grouped

    def _partner(self, resource: Resource, snapshot: Snapshot | None) -> _Binding | None:
        """The binding whose container is now asking for ``resource``, if any."""
        last = self._last
        if last is None or last.resource is resource or self._clock() - last.at > PAIR_WINDOW:
            return None
        holder = None
        if snapshot is not None and snapshot.taken_at >= last.at:
            holder = snapshot.holder_of(last.resource, last.first_id)
        if holder is None:
            return None if last.completed_pair else last
        if snapshot is not None and snapshot.devices.get(holder, {}).get(resource):
            return None  # that container holds this resource already: it is complete
        wanted = self.specs.requests_of(holder) if self.specs else None
        if wanted is not None:
            return last if wanted.get(resource, 0) > 0 else None
        return last

    def _snapshot(self, resource: Resource) -> Snapshot | None:
        """The kubelet's records, read only when a decision below will look at them:
        the partner rule (a binding of the other resource within the window) or the
        pod specs' hint. A read is a gRPC call to the kubelet, rate-limited."""
        last = self._last
        if self.records is None or last is None:
            return None
        pairing = last.resource is not resource and self._clock() - last.at <= PAIR_WINDOW
        if not pairing and self.specs is None:
            return None
        return self.records()

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
        healthy = self.health.healthy_cards()
        self.usage.observe_available(resource, free, healthy)
        snapshot = self._snapshot(resource)
        with self._lock:
            partner = self._partner(resource, snapshot)
            self._decided[resource] = (self._last, partner)
        other_need = None
        if partner is None and self.specs is not None:
            other_need = self.specs.other_need(resource, size, snapshot)
        other_free = self.usage.free_counts(resource.other)
        cards = [
            CardView(
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
            )
            for uuid, card in self.inventory.cards.items()
        ]
        request = Request(
            resource=resource,
            size=size,
            must_include=required,
            partner=partner.uuid if partner else None,
            other_need=other_need,
        )
        chosen = choose_card(cards, request, self.policy)
        if chosen is None:
            return []
        return [format_device_id(chosen.uuid, n) for n in preferred_units(chosen, request)]

    # -- Allocate --------------------------------------------------------------------
    def allocate(self, resource: Resource, device_ids: Sequence[str]) -> tuple[str, Answer]:
        """Bind one container's units of ``resource``; returns the card and the answer."""
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
            last_seen, partner = self._decided.pop(resource, (None, None))
        if last_seen is not self._last:  # no GetPreferredAllocation just before: decide now
            snapshot = self._snapshot(resource)
            with self._lock:
                partner = self._partner(resource, snapshot)
        with self._lock:
            if partner is not None and partner.uuid != uuid:
                self._last = None
                raise BindingError(
                    Refusal.PRECONDITION,
                    f"this container's {resource.other.value} units were just bound to "
                    f"{self._describe(partner.uuid)}, but its {resource.value} units are on "
                    f"{self._describe(uuid)}: no single card holds both requests",
                )
            binding = _Binding(
                resource, uuid, device_ids[0], self._clock(), completed_pair=partner is not None
            )
            self._last = binding
        cache_dir = None
        if resource is Resource.MEMORY and self.enforcement.library is not None:
            try:
                cache_dir = prepare_cache_dir(self.host_lib_dir, list(device_ids))
            except OSError as exc:
                with self._lock:
                    if self._last is binding:  # refused: nothing for the other to join
                        self._last = None
                raise BindingError(
                    Refusal.INTERNAL, f"cannot create the container's cache directory: {exc}"
                ) from None
        self.usage.record_allocation(resource, uuid, numbers)
        answer = build_answer(
            resource,
            uuid,
            len(numbers),
            memory_unit_mib=self.inventory.memory_unit_mib,
            enforcement=self.enforcement,
            cache_dir=cache_dir,
        )
        if self._on_allocated is not None:
            self._on_allocated(resource, uuid, device_ids)
        log.info(
            "allocated",
            resource=resource.value,
            gpu=uuid,
            index=self.inventory.cards[uuid].gpu.index,
            units=len(numbers),
            paired=partner is not None,
        )
        return uuid, answer
