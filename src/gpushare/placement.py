"""Which card a container gets: pure functions over plain data, no gRPC, no NVML.

The kubelet asks for one resource at a time (``GetPreferredAllocation`` then
``Allocate``), and for a container that wants both memory and core units it asks for
them back to back, in no fixed order. Whatever is placed first decides the card for
both, so the first placement must leave room for the second. See docs/placement.md.

The rules, in order:

1. Only healthy cards that hold ``size`` free units of the resource (and every
   ``must_include`` unit) are eligible.
2. If the container's other resource was just bound to a card (``partner``) and that
   card is eligible, it is the answer: both resources on one card.
3. If we know how much of the other resource will follow (``other_need``, a hint
   learned from the pod spec), choose by policy among the cards that hold both.
4. If we do not know, choose the eligible card with the most free units of the other
   resource. Then, if ANY card could hold both, this one can: that card has the most
   room for the second request among all cards that hold the first. Policy breaks ties.
5. If no card is eligible, answer the card with the most free units anyway; the
   kubelet pads the answer with units of other cards and Allocate refuses it clearly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpushare.devices import Resource

BINPACK = "binpack"
SPREAD = "spread"


@dataclass(frozen=True)
class CardView:
    """One card as placement sees it at the moment of a request."""

    uuid: str
    index: int
    free_units: tuple[int, ...]  # free unit numbers of the resource being placed
    memory_free: int
    core_free: int
    healthy: bool = True


@dataclass(frozen=True)
class Request:
    """One container's request for one resource."""

    resource: Resource
    size: int
    must_include: Mapping[str, Sequence[int]] = field(default_factory=dict)
    partner: str | None = None
    other_need: int | None = None


def _other_free(card: CardView, resource: Resource) -> int:
    return card.core_free if resource is Resource.MEMORY else card.memory_free


def _policy_key(card: CardView, request: Request, policy: str) -> tuple[int, ...]:
    uses_memory = request.resource is Resource.MEMORY or request.other_need != 0
    key: tuple[int, ...] = (card.memory_free, card.core_free) if uses_memory else (card.core_free,)
    if policy == SPREAD:
        key = tuple(-k for k in key)
    return (*key, card.index)


def eligible_cards(cards: Sequence[CardView], request: Request) -> list[CardView]:
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


def choose_card(cards: Sequence[CardView], request: Request, policy: str) -> CardView | None:
    """The card for this request by the rules above; None only when there are no cards."""
    eligible = eligible_cards(cards, request)
    if not eligible:
        return max(cards, key=lambda c: (c.healthy, len(c.free_units), -c.index), default=None)
    for card in eligible:
        if card.uuid == request.partner:
            return card
    if request.other_need is not None:
        both = [c for c in eligible if _other_free(c, request.resource) >= request.other_need]
        return min(both or eligible, key=lambda c: _policy_key(c, request, policy))
    return min(
        eligible,
        key=lambda c: (-_other_free(c, request.resource), *_policy_key(c, request, policy)),
    )


def preferred_units(card: CardView, request: Request) -> list[int]:
    """The unit numbers to offer on ``card``: must-include first, then the lowest free."""
    chosen = list(dict.fromkeys(request.must_include.get(card.uuid, ())))
    taken = set(chosen)
    for n in card.free_units:
        if len(chosen) >= request.size:
            break
        if n not in taken:
            chosen.append(n)
    return chosen
