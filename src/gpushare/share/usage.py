"""Which units are in use, per resource and card, as far as the plugin can tell.

Three sources feed it, all of them the kubelet's own view:

* the ``available_deviceIDs`` of every GetPreferredAllocation: the exact free set of
  that resource at that moment (on healthy cards);
* every Allocate the plugin answers, until the next source confirms it;
* the PodResources API, read on start and then periodically: who holds what.

Nothing is stored on disk: a restarted daemon learns the same numbers from the kubelet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gpushare.share.devices import Inventory, Resource

#: How long an Allocate is remembered on top of a PodResources snapshot taken before it.
RECENT_ALLOCATION_SECONDS = 30.0


@dataclass(frozen=True)
class Holder:
    """A container holding units, as PodResources names it."""

    namespace: str
    pod: str
    container: str


class UsageLedger:
    """Thread-safe per-card record of used unit numbers for both resources."""

    def __init__(self, inventory: Inventory, clock: Callable[[], float] = time.monotonic) -> None:
        self._inventory = inventory
        self._clock = clock
        self._lock = threading.Lock()
        self._used: dict[Resource, dict[str, set[int]]] = {
            resource: {uuid: set() for uuid in inventory.cards} for resource in Resource
        }
        self._recent: list[tuple[float, Resource, str, tuple[int, ...]]] = []
        self._holders: dict[str, dict[Holder, dict[Resource, int]]] = {}

    # -- feeding -------------------------------------------------------------------
    def observe_available(
        self, resource: Resource, free_by_card: Mapping[str, Iterable[int]], healthy: Iterable[str]
    ) -> None:
        """The kubelet offered exactly these free units; the rest of a healthy card is used."""
        with self._lock:
            for uuid in healthy:
                card = self._inventory.cards[uuid]
                free = set(free_by_card.get(uuid, ()))
                self._used[resource][uuid] = set(range(card.units(resource))) - free

    def record_allocation(self, resource: Resource, uuid: str, units: Iterable[int]) -> None:
        numbers = tuple(units)
        with self._lock:
            self._used[resource][uuid].update(numbers)
            self._recent.append((self._clock(), resource, uuid, numbers))

    def replace(
        self,
        used: Mapping[Resource, Mapping[str, Iterable[int]]],
        holders: Mapping[str, Mapping[Holder, Mapping[Resource, int]]],
        taken_at: float,
    ) -> None:
        """Adopt a PodResources snapshot taken at ``taken_at`` (clock time).

        Allocations answered after ``taken_at`` are kept on top of it: the snapshot
        could not have seen them yet.
        """
        with self._lock:
            fresh: dict[Resource, dict[str, set[int]]] = {
                r: {u: set() for u in self._inventory.cards} for r in Resource
            }
            for resource, by_card in used.items():
                for uuid, numbers in by_card.items():
                    if uuid in fresh[resource]:
                        fresh[resource][uuid].update(numbers)
            horizon = self._clock() - RECENT_ALLOCATION_SECONDS
            self._recent = [entry for entry in self._recent if entry[0] >= horizon]
            for at, resource, uuid, numbers in self._recent:
                if at >= taken_at:
                    fresh[resource][uuid].update(numbers)
            self._used = fresh
            self._holders = {
                uuid: {holder: dict(units) for holder, units in by_holder.items()}
                for uuid, by_holder in holders.items()
            }

    # -- reading -------------------------------------------------------------------
    def used_counts(self, resource: Resource) -> dict[str, int]:
        with self._lock:
            return {uuid: len(numbers) for uuid, numbers in self._used[resource].items()}

    def free_counts(self, resource: Resource) -> dict[str, int]:
        used = self.used_counts(resource)
        return {
            uuid: card.units(resource) - used[uuid] for uuid, card in self._inventory.cards.items()
        }

    def holders(self) -> dict[str, dict[Holder, dict[Resource, int]]]:
        """Per card, the containers PodResources last reported on it and their units."""
        with self._lock:
            return {uuid: dict(h) for uuid, h in self._holders.items()}
