"""Device IDs to (card, unit number), precomputed: parsing tens of thousands of IDs per
request would dominate the request's cost. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.share.devices import InvalidDeviceIds, Inventory, Resource, format_device_id


class UnitIndex:
    """Every unit ID of the inventory, both resources, mapped to its card and number."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self._index: dict[Resource, dict[str, tuple[str, int]]] = {
            resource: {
                format_device_id(card.uuid, n): (card.uuid, n)
                for card in inventory.cards.values()
                for n in range(card.units(resource))
            }
            for resource in Resource
        }

    def group(self, resource: Resource, device_ids: Sequence[str]) -> dict[str, list[int]]:
        """Card UUID -> the unit numbers named, in request order. :class:`InvalidDeviceIds`
        for an ID that is not one of this node's units or that is listed twice."""
        # One Python string per ID (a protobuf field makes a new one on every access),
        # so each is hashed once: by the lookups, then reused by the duplicate check.
        ids = list(device_ids)
        try:
            located = list(map(self._index[resource].__getitem__, ids))
        except (KeyError, TypeError):
            # Slow path, only to explain what is wrong (and catch duplicates below).
            self.inventory.resolve(resource, ids)
            raise InvalidDeviceIds("unknown device ID") from None
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            twice = next(d for d in ids if d in seen or seen.add(d))  # type: ignore[func-returns-value]
            raise InvalidDeviceIds(f"{twice!r} is listed twice")
        grouped: dict[str, list[int]] = {}
        for uuid, n in located:
            numbers = grouped.get(uuid)
            if numbers is None:
                grouped[uuid] = numbers = []
            numbers.append(n)
        return grouped
