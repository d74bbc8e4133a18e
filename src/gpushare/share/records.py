"""The kubelet's records of who holds which devices, as plain data.

One :class:`Snapshot` is one answer of the kubelet's PodResources ``List``, restricted to
gpushare's resources. The core decides over it (pairing, exclusion, the unit-size guard,
the cache-directory GC); the client that reads it from the kubelet's socket is a front
door's business (:mod:`gpushare.node.podresources`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpushare.share.devices import SEPARATOR, Resource, parse_unit_number
from gpushare.share.usage import Holder


@dataclass(frozen=True)
class Snapshot:
    """One List answer, restricted to gpushare's resources."""

    taken_at: float  # when the read began (clock time): it shows everything recorded before
    # (resource, device ID) -> the container holding it
    holders: dict[tuple[Resource, str], Holder] = field(default_factory=dict)
    # container -> resource -> device IDs
    devices: dict[Holder, dict[Resource, list[str]]] = field(default_factory=dict)
    # exclusive resources (whole cards, MIG): full resource name -> device ID -> holder
    exclusive: dict[str, dict[str, Holder]] = field(default_factory=dict)

    @classmethod
    def joined(cls, taken_at: float, parts: Iterable[Snapshot]) -> Snapshot:
        """The snapshot of one answer from the snapshots of its pods, each read on its
        own (and kept from answer to answer while the pod's entry is unchanged).

        Equal to reading the pods together. The per-card counts (:attr:`used_counts`) are
        summed from each part's own, which a part computes once: joining costs per pod,
        not per device held (the kubelet lists one entry per device, thousands on a big
        node, and this runs on every GetPreferredAllocation)."""
        joined = cls(taken_at)
        holders, devices, exclusive = joined.holders, joined.devices, joined.exclusive
        counts: dict[Resource, dict[str, int]] = {r: {} for r in Resource}
        listed = 0
        for part in parts:
            holders.update(part.holders)
            listed += len(part.holders)
            for holder, held in part.devices.items():
                mine = devices.setdefault(holder, {})
                for resource, ids in held.items():
                    mine.setdefault(resource, []).extend(ids)
            for name, owners in part.exclusive.items():
                exclusive.setdefault(name, {}).update(owners)
            for resource, by_card in part.used_counts.items():
                total = counts[resource]
                for uuid, n in by_card.items():
                    total[uuid] = total.get(uuid, 0) + n
        if listed == len(holders):  # no device listed twice: the sums are the counts
            joined.__dict__["used_counts"] = counts  # the cached property's own slot
        return joined

    def holder_of(self, resource: Resource, device_id: str) -> Holder | None:
        return self.holders.get((resource, device_id))

    def used_by_card(self) -> dict[Resource, dict[str, list[int]]]:
        """Per resource and card, the unit numbers some container holds (IDs that are not
        gpushare's, e.g. with non-ASCII digits, are skipped: no card has them)."""
        used: dict[Resource, dict[str, list[int]]] = {r: {} for r in Resource}
        for resource, device_id in self.holders:
            uuid, _, number = device_id.rpartition(SEPARATOR)
            n = parse_unit_number(number)
            if n is not None:
                used[resource].setdefault(uuid, []).append(n)
        return used

    @functools.cached_property
    def used_counts(self) -> dict[Resource, dict[str, int]]:
        """Per resource and card, how many units some container holds (computed once)."""
        counts: dict[Resource, dict[str, int]] = {r: {} for r in Resource}
        for resource, device_id in self.holders:
            uuid = device_id.rpartition(SEPARATOR)[0]
            by_card = counts[resource]
            by_card[uuid] = by_card.get(uuid, 0) + 1
        return counts

    def unlisted_on(self, resource: Resource, taken: Mapping[str, int]) -> set[str]:
        """The cards on which more units of ``resource`` are ``taken`` (card UUID ->
        units, as the kubelet's own offer shows them) than these records list holders
        for: someone unlisted holds units there (an ordinary init container, or, right
        after a kubelet restart, a running pod the kubelet has not added back to its pod
        manager yet: it admits its first batch in creation order, to the second, and
        lists only the pods added so far)."""
        listed = self.used_counts[resource]
        return {uuid for uuid, n in taken.items() if n > listed.get(uuid, 0)}

    def holders_by_card(self) -> dict[str, dict[Holder, dict[Resource, int]]]:
        """Per card, each container on it and how many units of each resource it holds."""
        cards: dict[str, dict[Holder, dict[Resource, int]]] = {}
        for (resource, device_id), holder in self.holders.items():
            uuid = device_id.rpartition(SEPARATOR)[0]
            units = cards.setdefault(uuid, {}).setdefault(holder, {})
            units[resource] = units.get(resource, 0) + 1
        return cards

    def numbers_by_holder(self) -> dict[tuple[str, Holder], dict[Resource, set[int]]]:
        """Per (card, container), the unit numbers it holds of each resource."""
        held: dict[tuple[str, Holder], dict[Resource, set[int]]] = {}
        for (resource, device_id), holder in self.holders.items():
            uuid, _, number = device_id.rpartition(SEPARATOR)
            n = parse_unit_number(number)
            if n is not None:
                held.setdefault((uuid, holder), {}).setdefault(resource, set()).add(n)
        return held
