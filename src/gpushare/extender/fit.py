"""Can this node hold this pod, each GPU container on ONE card? Pure functions over plain data.

The kubelet and the default scheduler only see a node's totals of ``vcuda-memory`` and
``vcuda-core``. This module looks at the cards, and the decision is not its own: it
reads the pod and the node's published cards and asks ``placement.place_pod``, whose
containers go where ``placement.place_containers`` puts them, the function the
daemon's binder calls, so the card predicted for each container is the card the
daemon will choose; what is left here is to tell a misfit in the cards' words. The
containers of one pod are placed together, so their sum counts on a shared card.

A container asking only memory needs no core units; one asking only cores needs no
memory units (its limit is then the whole card's memory, but it holds no units).

Ordinary init containers run one at a time before the app containers and the kubelet
hands their units on to them, so each must fit alone; sidecar init containers
(``restartPolicy: Always``) keep running and are placed with the app containers, in
admission order (as ``podspecs.py`` tells the daemon).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from gpushare.base.compat import zip_strict
from gpushare.kube.nodestate import NodeGpuState
from gpushare.share.placement import BINPACK, Need, PodPlacement, Policy, Room, place_pod

__all__ = ["BINPACK", "PLACEMENTS", "Policy"]

#: The placement policies' names (command-line choices).
PLACEMENTS = tuple(policy.value for policy in Policy)

#: kube-scheduler's MaxExtenderPriority: an extender's scores lie in 0..10.
MAX_SCORE = 10


class PodSpecError(ValueError):
    """The pod's resource requests cannot be read."""


@dataclass(frozen=True)
class ContainerNeed:
    """What one container asks for, in units."""

    name: str
    memory_units: int
    core_units: int

    @property
    def need(self) -> Need:
        return Need(self.memory_units, self.core_units)


@dataclass(frozen=True)
class PodNeed:
    """The GPU containers of a pod (containers asking for neither resource are left out)."""

    #: placed together, in admission order: sidecar init containers, then app containers
    containers: tuple[ContainerNeed, ...]
    #: ordinary init containers, each placed alone before the others
    init_containers: tuple[ContainerNeed, ...] = ()

    @property
    def memory_units(self) -> int:
        return sum(c.memory_units for c in self.containers)

    @property
    def core_units(self) -> int:
        return sum(c.core_units for c in self.containers)

    @property
    def wants_gpu(self) -> bool:
        return bool(self.containers or self.init_containers)


@dataclass(frozen=True)
class CardRoom:
    """One card's free room as the extender sees it."""

    uuid: str
    index: int
    memory_units: int
    memory_free: int
    core_free: int
    healthy: bool = True
    core_units: int = 100

    def holds(self, need: ContainerNeed) -> bool:
        return (
            self.healthy
            and self.memory_free >= need.memory_units
            and self.core_free >= need.core_units
        )

    def minus(self, memory_units: int, core_units: int) -> CardRoom:
        return CardRoom(
            self.uuid,
            self.index,
            self.memory_units,
            self.memory_free - memory_units,
            self.core_free - core_units,
            self.healthy,
            self.core_units,
        )

    @property
    def label(self) -> str:
        return f"GPU{self.index}"

    @cached_property
    def room(self) -> Room:
        """The card as placement sees it (made once: a node's rooms are kept between
        requests, and a filter for a new pod shape asks for them on every node)."""
        return Room(self.uuid, self.index, self.memory_free, self.core_free, self.healthy)


@dataclass(frozen=True)
class Placement:
    """The card (by UUID) predicted for each app container, in spec order."""

    cards: tuple[tuple[str, ContainerNeed], ...]

    def use_by_card(self) -> dict[str, tuple[int, int]]:
        """UUID -> (memory units, core units) this pod takes there."""
        use: dict[str, tuple[int, int]] = {}
        for uuid, need in self.cards:
            memory, core = use.get(uuid, (0, 0))
            use[uuid] = (memory + need.memory_units, core + need.core_units)
        return use


@dataclass(frozen=True)
class Fit:
    """The verdict for one node: a placement, or the reason in an operator's words."""

    placement: Placement | None
    reason: str = ""
    rooms_after: tuple[CardRoom, ...] = ()

    @property
    def fits(self) -> bool:
        return self.placement is not None


# -- reading the pod ---------------------------------------------------------------


#: A whole number of units as the API server serialises it: ASCII digits, or a
#: multiple of 1000 in its canonical form (``1k`` for 1000).
_QUANTITY = re.compile(r"([0-9]{1,12})(k|M)?")
_SUFFIX = {None: 1, "k": 1000, "M": 1000_000}


def _units(resources: Mapping[str, Any], name: str, where: str) -> int:
    value = resources.get(name)
    if value is None:
        return 0
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**12:
        return value
    if match is None:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise PodSpecError(f"{where}: {name} must be a whole number of units, got {shown}")
    return int(match[1]) * _SUFFIX[match[2]]


def container_need(container: Mapping[str, Any], prefix: str) -> ContainerNeed:
    """Units a container spec asks for: limits, else requests (extended resources)."""
    if not isinstance(container, Mapping):
        raise PodSpecError("a container must be an object")
    name = str(container.get("name", ""))[:253]
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise PodSpecError(f"container {name!r}: resources must be an object")
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    if not isinstance(limits, Mapping) or not isinstance(requests, Mapping):
        raise PodSpecError(f"container {name!r}: limits and requests must be objects")
    where = f"container {name!r}"
    memory_name, core_name = f"{prefix}/vcuda-memory", f"{prefix}/vcuda-core"
    return ContainerNeed(
        name=name,
        memory_units=_units(limits, memory_name, where) or _units(requests, memory_name, where),
        core_units=_units(limits, core_name, where) or _units(requests, core_name, where),
    )


def pod_need(pod: Mapping[str, Any], prefix: str) -> PodNeed:
    """The GPU containers of a Pod object (as JSON from the API server)."""
    if not isinstance(pod, Mapping):
        raise PodSpecError("the pod must be an object")
    spec = pod.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise PodSpecError("the pod's spec must be an object")

    def listed(key: str) -> list[Mapping[str, Any]]:
        items = spec.get(key) or []
        if not isinstance(items, list):
            raise PodSpecError(f"the pod's spec.{key} must be a list")
        return items

    def wants_gpu(need: ContainerNeed) -> bool:
        return bool(need.memory_units or need.core_units)

    inits: list[ContainerNeed] = []
    together: list[ContainerNeed] = []
    for container in listed("initContainers"):
        need = container_need(container, prefix)
        if wants_gpu(need):
            sidecar = container.get("restartPolicy") == "Always"
            (together if sidecar else inits).append(need)
    for container in listed("containers"):
        need = container_need(container, prefix)
        if wants_gpu(need):
            together.append(need)
    return PodNeed(tuple(together), tuple(inits))


# -- reading the node --------------------------------------------------------------


#: Larger counts than any card has; a published value outside 0..this is not believed.
MAX_COUNT = 1 << 30


def card_rooms(state: NodeGpuState) -> tuple[CardRoom, ...]:
    """Free room per card from the node's published state, in index order.

    A ValueError if a count is negative or absurdly large (it would poison arithmetic)."""
    for card in state.cards:
        counts = (card.index, card.memory_units, card.memory_units_used)
        if not all(0 <= n <= MAX_COUNT for n in (*counts, card.core_units, card.core_units_used)):
            raise ValueError(f"card {card.uuid[:64]!r} publishes a count out of range")
    rooms = (
        CardRoom(
            uuid=card.uuid,
            index=card.index,
            memory_units=card.memory_units,
            memory_free=card.memory_units_free,
            core_free=card.core_units_free,
            healthy=card.healthy,
            core_units=card.core_units,
        )
        for card in state.cards
    )
    return tuple(sorted(rooms, key=lambda room: room.index))


def subtract(
    rooms: Sequence[CardRoom], use_by_card: Mapping[str, tuple[int, int]]
) -> tuple[CardRoom, ...]:
    """Rooms after ``use_by_card`` (UUID -> memory, core units) is taken; never below 0."""
    result = []
    for room in rooms:
        memory, core = use_by_card.get(room.uuid, (0, 0))
        result.append(
            replace(
                room,
                memory_free=max(0, room.memory_free - memory),
                core_free=max(0, room.core_free - core),
            )
        )
    return tuple(result)


# -- deciding ----------------------------------------------------------------------


def _rooms(rooms: Sequence[CardRoom]) -> list[Room]:
    return [r.room for r in rooms]


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _describe_need(need: ContainerNeed) -> str:
    memory = _count(need.memory_units, "free unit")
    cores = _count(need.core_units, "free core unit")
    if need.memory_units and need.core_units:
        return f"{memory} and {cores}"
    return cores if need.core_units else memory


def _describe_room(room: CardRoom, need: ContainerNeed) -> str:
    if not room.healthy:
        return f"{room.label} unhealthy"
    if need.memory_units and need.core_units:
        return f"{room.label} {room.memory_free} units/{room.core_free} cores"
    if need.core_units:
        return f"{room.label} {room.core_free}"
    return f"{room.label} {room.memory_free}"


def explain_misfit(
    rooms: Sequence[CardRoom],
    need: ContainerNeed,
    placed_before: Sequence[tuple[str, ContainerNeed]] = (),
    init: bool = False,
) -> str:
    """``no single card has 12 free units: GPU0 8, GPU1 8`` and the like."""
    if not rooms:
        return "the node publishes no cards"
    if not any(room.healthy for room in rooms):
        return "no healthy card: " + ", ".join(f"{room.label} unhealthy" for room in rooms)
    text = f"no single card has {_describe_need(need)}"
    if init:
        text += f" for init container {need.name}"
    elif placed_before:
        labels = {room.uuid: room.label for room in rooms}
        earlier = ", ".join(f"{c.name} on {labels.get(uuid, uuid)}" for uuid, c in placed_before)
        text += f" for container {need.name} after placing {earlier}"
    return text + ": " + ", ".join(_describe_room(room, need) for room in rooms)


def _misfit(rooms: Sequence[CardRoom], pod: PodNeed, plan: PodPlacement) -> str:
    """Why the pod does not fit, told at the container placement stopped at: an init
    container alone, or a container after those before it took their best cards."""
    if plan.init_misfit is not None:
        return explain_misfit(rooms, pod.init_containers[plan.init_misfit], init=True)
    if plan.misfit is None:
        return explain_misfit(rooms, pod.containers[0]) if pod.containers else "no card"
    placed = [(uuid, pod.containers[i]) for i, uuid in enumerate(plan.placed)]
    current = list(rooms)
    for uuid, need in placed:
        current = [
            r.minus(need.memory_units, need.core_units) if r.uuid == uuid else r for r in current
        ]
    return explain_misfit(current, pod.containers[plan.misfit], placed)


def fit_pod(rooms: Sequence[CardRoom], pod: PodNeed, policy: str = BINPACK) -> Fit:
    """The cards the daemon will give the pod's containers (``placement``), or why not:
    placement decides the whole pod at once, then the misfit is told in cards' words."""
    cards = _rooms(rooms)
    init_needs = [c.need for c in pod.init_containers]
    plan = place_pod(cards, init_needs, [c.need for c in pod.containers], Policy.parse(policy))
    if plan.cards is None:
        return Fit(None, _misfit(rooms, pod, plan))
    placement = Placement(tuple(zip_strict(plan.cards, pod.containers)))
    use = placement.use_by_card()
    after = tuple(r.minus(*use[r.uuid]) if r.uuid in use else r for r in rooms)
    return Fit(placement, rooms_after=after)


def score(fit: Fit, policy: str = BINPACK) -> int:
    """0..MAX_SCORE: binpack favours the node whose card is fullest after placement,
    spread the one whose card stays emptiest. A node that cannot hold the pod scores 0."""
    if fit.placement is None:
        return 0
    used_cards = {uuid for uuid, _need in fit.placement.cards}
    fullness = 0.0
    for room in fit.rooms_after:
        if room.uuid not in used_cards:
            continue
        memory = 1 - room.memory_free / room.memory_units if room.memory_units else 1.0
        core = 1 - room.core_free / room.core_units if room.core_units else 1.0
        fullness = max(fullness, memory, core)
    if not used_cards:  # a pod with no GPU container: every node is as good
        fullness = 0.5
    value = fullness if Policy.parse(policy) is Policy.BINPACK else 1 - fullness
    return max(0, min(MAX_SCORE, int(value * MAX_SCORE + 0.5)))
