"""Which card a container gets: pure functions over plain data, no gRPC, no NVML.

This is the ONE placement of gpushare: the node daemon's binder (``binding.py``) and
the scheduler extender (``extender/``) both call it, so the extender predicts exactly
the card the daemon will choose. See docs/placement.md.

Two levels:

* **Containers and pods** (:func:`rank`, :func:`place_containers`): given each card's
  free memory and core units and what the containers of a pod need, in the kubelet's
  admission order, choose one card per container. A card is a candidate for a
  container when it holds BOTH of its needs; candidates are ranked by the policy
  (binpack: the fullest first; spread: the emptiest first; the GPU index breaks
  ties). The pod is placed as a whole: the first container takes its best-ranked card
  from which the remaining containers can still be placed (a bounded depth-first
  search), so two containers of one pod never block each other needlessly.
* **One kubelet request** (:func:`choose_card`): the kubelet asks for one resource at
  a time (GetPreferredAllocation, then Allocate), in no fixed order. The binder
  passes what it knows: the card the container is bound to already (``partner``), the
  card its pod's plan gives it (``prefer``), or how much of the other resource will
  follow (``other_need``). Rules, in order:

  1. Only healthy cards holding ``size`` free units (and every ``must_include`` unit)
     are eligible.
  2. ``partner``: that card, if eligible (else Allocate will refuse the request).
  3. ``prefer``: that card, if eligible.
  4. ``other_need`` known: by policy among the eligible cards that hold both; if none
     does, among those whose room of the other resource is not known but may hold it
     (``other_at_most``: someone the kubelet's records do not list holds units there),
     before cards known to lack it.
  5. Nothing known: the eligible card with the most free units of the other resource;
     if ANY card could hold both requests, this one can. Policy breaks ties.
  6. No card is eligible: the card with the most free units, so that the kubelet pads
     the answer and Allocate refuses it with a clear message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpushare.base.compat import StrEnum
from gpushare.share.devices import Resource


class Policy(StrEnum):
    """How cards are ranked for a container: pack them full, or spread the load."""

    BINPACK = "binpack"
    SPREAD = "spread"

    @classmethod
    def parse(cls, value: str | Policy) -> Policy:
        if isinstance(value, Policy):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown placement policy {value!r} (one of {choices})") from None


BINPACK = Policy.BINPACK
SPREAD = Policy.SPREAD

#: Depth-first search over a pod's containers stops after this many card trials and
#: keeps the greedy answer: pods have a handful of containers, nodes a handful of cards.
SEARCH_LIMIT = 4096


@dataclass(frozen=True)
class Need:
    """What one container asks for, in units of each resource."""

    memory: int
    core: int

    def of(self, resource: Resource) -> int:
        return self.memory if resource is Resource.MEMORY else self.core


@dataclass(frozen=True)
class Room:
    """One card's free units as placement sees them."""

    uuid: str
    index: int
    memory_free: int
    core_free: int
    healthy: bool = True

    def holds(self, need: Need) -> bool:
        return self.healthy and self.memory_free >= need.memory and self.core_free >= need.core

    def minus(self, need: Need) -> Room:
        return Room(
            self.uuid,
            self.index,
            self.memory_free - need.memory,
            self.core_free - need.core,
            self.healthy,
        )


def policy_key(
    memory_free: int, core_free: int, index: int, uses_memory: bool, policy: Policy
) -> tuple[int, ...]:
    """Sort key of a card: memory then cores (only cores for a container without
    memory), ascending for binpack, descending for spread, then the GPU index."""
    key: tuple[int, ...] = (memory_free, core_free) if uses_memory else (core_free,)
    if policy is Policy.SPREAD:
        key = tuple(-k for k in key)
    return (*key, index)


def _order(need: Need, policy: Policy) -> Callable[[Room], tuple[int, ...]]:
    """The sort key of the cards for ``need`` (:func:`policy_key`): one rule for
    :func:`rank` and :func:`best`."""
    uses_memory = need.memory > 0
    return lambda r: policy_key(r.memory_free, r.core_free, r.index, uses_memory, policy)


def rank(rooms: Sequence[Room], need: Need, policy: Policy) -> list[Room]:
    """The cards that hold ``need``, best first."""
    return sorted((room for room in rooms if room.holds(need)), key=_order(need, policy))


def best(rooms: Sequence[Room], need: Need, policy: Policy) -> Room | None:
    """``rank(rooms, need, policy)[0]`` (None when no card holds ``need``), without
    sorting the others: the answer for a pod of one container."""
    return min((room for room in rooms if room.holds(need)), key=_order(need, policy), default=None)


def place_containers(
    rooms: Sequence[Room], needs: Sequence[Need], policy: Policy
) -> tuple[str, ...] | None:
    """One card UUID per container (in order), the pod placed as a whole; None if no
    assignment of whole containers to single cards exists (within the search limit).

    The answer is the first feasible assignment in policy order: the first container
    gets the best-ranked card from which the others still fit, and so on. Placing the
    first container and calling again for the rest gives the same remaining cards.
    """
    if len(needs) == 1:  # what the search below finds for one container, without it
        chosen = best(rooms, needs[0], policy)
        return (chosen.uuid,) if chosen is not None else None
    trials = 0

    def search(current: Sequence[Room], position: int) -> list[str] | None:
        nonlocal trials
        if position == len(needs):
            return []
        need = needs[position]
        for room in rank(current, need, policy):
            trials += 1
            if trials > SEARCH_LIMIT:
                return None
            after = [r.minus(need) if r.uuid == room.uuid else r for r in current]
            rest = search(after, position + 1)
            if rest is not None:
                return [room.uuid, *rest]
        return None

    found = search(list(rooms), 0)
    if found is None and trials > SEARCH_LIMIT:
        return _greedy(rooms, needs, policy)
    return tuple(found) if found is not None else None


@dataclass(frozen=True)
class PodPlacement:
    """A whole pod placed (:func:`place_pod`), or the container that stops it."""

    #: one card UUID per container, in order; None: the pod does not fit
    cards: tuple[str, ...] | None
    #: the first init container that finds no card alone
    init_misfit: int | None = None
    #: where the containers do not fit together: the first that finds no card when
    #: those before it take their best cards (None: each finds one, yet no assignment
    #: holds them all), and the cards those before it took
    misfit: int | None = None
    placed: tuple[str, ...] = ()


def place_pod(
    rooms: Sequence[Room], init_needs: Sequence[Need], needs: Sequence[Need], policy: Policy
) -> PodPlacement:
    """A pod on the node's cards: each ordinary init container alone first (each must
    find a card), then the containers together (:func:`place_containers`). Where the
    pod does not fit, which container stops it, so that the caller can say why."""
    for position, need in enumerate(init_needs):
        if best(rooms, need, policy) is None:
            return PodPlacement(None, init_misfit=position)
    cards = place_containers(rooms, needs, policy)
    if cards is not None:
        return PodPlacement(cards)
    return _greedy_stop(rooms, needs, policy)


def _greedy_stop(rooms: Sequence[Room], needs: Sequence[Need], policy: Policy) -> PodPlacement:
    """The containers placed one by one on their best cards: the first that finds none
    (if no assignment exists, this one fails) and the cards taken before it."""
    current = list(rooms)
    placed: list[str] = []
    for position, need in enumerate(needs):
        chosen = best(current, need, policy)
        if chosen is None:
            return PodPlacement(None, misfit=position, placed=tuple(placed))
        placed.append(chosen.uuid)
        current = [r.minus(need) if r.uuid == chosen.uuid else r for r in current]
    return PodPlacement(None)


def plan_fits(rooms: Sequence[Room], needs: Sequence[Need], cards: Sequence[str]) -> bool:
    """Whether the containers of ``needs`` fit together on ``cards`` (one per container,
    healthy cards only)."""
    if len(cards) != len(needs):
        return False
    left = {room.uuid: room for room in rooms if room.healthy}
    for uuid, need in zip(cards, needs, strict=True):
        room = left.get(uuid)
        if room is None or room.memory_free < need.memory or room.core_free < need.core:
            return False
        left[uuid] = room.minus(need)
    return True


def _greedy(rooms: Sequence[Room], needs: Sequence[Need], policy: Policy) -> tuple[str, ...] | None:
    current = list(rooms)
    chosen = []
    for need in needs:
        ranked = rank(current, need, policy)
        if not ranked:
            return None
        uuid = ranked[0].uuid
        chosen.append(uuid)
        current = [r.minus(need) if r.uuid == uuid else r for r in current]
    return tuple(chosen)


# -- one kubelet request -----------------------------------------------------------


@dataclass(frozen=True)
class CandidateCard:
    """One card as placement sees it at the moment of a request."""

    uuid: str
    index: int
    free_units: tuple[int, ...]  # free unit numbers of the resource being placed
    memory_free: int
    core_free: int
    healthy: bool = True
    #: Where the free units of the other resource are not known (its ``memory_free`` or
    #: ``core_free`` then says 0): the most that can be free. None: they are known.
    other_at_most: int | None = None


@dataclass(frozen=True)
class Request:
    """One container's request for one resource."""

    resource: Resource
    size: int
    must_include: Mapping[str, Sequence[int]] = field(default_factory=dict)
    partner: str | None = None
    prefer: str | None = None
    other_need: int | None = None


def _other_free(card: CandidateCard, resource: Resource) -> int:
    return card.core_free if resource is Resource.MEMORY else card.memory_free


def _request_key(card: CandidateCard, request: Request, policy: Policy) -> tuple[int, ...]:
    uses_memory = request.resource is Resource.MEMORY or request.other_need != 0
    return policy_key(card.memory_free, card.core_free, card.index, uses_memory, policy)


def eligible_cards(cards: Sequence[CandidateCard], request: Request) -> list[CandidateCard]:
    """Rule 1: healthy cards holding the request and all its must-include units."""
    if len(request.must_include) > 1:
        return []
    eligible = []
    for card in cards:
        if not card.healthy or len(card.free_units) < request.size:
            continue
        required = request.must_include.get(card.uuid)
        if request.must_include and required is None:
            continue
        if required and not set(required) <= set(card.free_units):
            continue
        eligible.append(card)
    return eligible


def choose_card(
    cards: Sequence[CandidateCard], request: Request, policy: Policy | str
) -> CandidateCard | None:
    """The card for this request by the rules above; None only when there are no cards."""
    policy = Policy.parse(policy)
    eligible = eligible_cards(cards, request)
    if not eligible:
        return max(cards, key=lambda c: (c.healthy, len(c.free_units), -c.index), default=None)
    for wanted in (request.partner, request.prefer):
        if wanted is not None:
            for card in eligible:
                if card.uuid == wanted:
                    return card
            if wanted == request.partner:
                break  # the partner's card cannot take it: Allocate will say so
    if request.other_need is not None:
        need = request.other_need
        both = [c for c in eligible if _other_free(c, request.resource) >= need]
        maybe = [c for c in eligible if c.other_at_most is not None and c.other_at_most >= need]
        return min(both or maybe or eligible, key=lambda c: _request_key(c, request, policy))
    return min(
        eligible,
        key=lambda c: (-_other_free(c, request.resource), *_request_key(c, request, policy)),
    )


def preferred_units(card: CandidateCard, request: Request) -> list[int]:
    """The unit numbers to offer on ``card``: must-include first, then the lowest free."""
    chosen = list(dict.fromkeys(request.must_include.get(card.uuid, ())))
    taken = set(chosen)
    for n in card.free_units:
        if len(chosen) >= request.size:
            break
        if n not in taken:
            chosen.append(n)
    return chosen
