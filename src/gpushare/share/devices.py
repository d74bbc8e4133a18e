"""The device IDs gpushare advertises, and the way back from an ID to its card.

Every card is advertised twice: as ``floor(memory / unit)`` memory units and as 100
core units. A unit's ID is ``<card UUID>::<n>`` with ``n`` counted from 0, so IDs are
stable across restarts and the kubelet's records can be read without any checkpoint.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpushare.gpu.gpus import Gpu

SEPARATOR = "::"
MAX_DEVICE_ID_LENGTH = 63
CORE_UNITS_PER_CARD = 100


class Resource(enum.Enum):
    """The two resources of a card; the value is the resource name without its prefix."""

    MEMORY = "vcuda-memory"
    CORE = "vcuda-core"

    @property
    def other(self) -> Resource:
        return Resource.CORE if self is Resource.MEMORY else Resource.MEMORY

    def name_with(self, prefix: str) -> str:
        return f"{prefix}/{self.value}"

    @property
    def socket_name(self) -> str:
        return f"gpushare-{self.value}.sock"


class InvalidDeviceIds(ValueError):
    """The IDs do not name units of this resource on this node."""


def format_device_id(uuid: str, n: int) -> str:
    return f"{uuid}{SEPARATOR}{n}"


#: More digits than any unit number can have (and far below int()'s 4300-digit limit).
MAX_UNIT_DIGITS = 9


def parse_unit_number(text: str) -> int | None:
    """``"7"`` -> 7. Only the form gpushare writes: ASCII digits, no sign, space or
    leading zero, at most :data:`MAX_UNIT_DIGITS`. ``str.isdigit`` alone would accept
    ``"٣"`` (which ``int`` reads as 3: a second spelling of unit 3) and ``"²"`` (which
    ``int`` rejects with ValueError); None for those and anything else."""
    if not 0 < len(text) <= MAX_UNIT_DIGITS or not text.isascii() or not text.isdigit():
        return None
    if len(text) > 1 and text[0] == "0":
        return None
    return int(text)


def parse_device_id(device_id: str) -> tuple[str, int]:
    """``GPU-x::7`` -> ``("GPU-x", 7)``; anything else raises :class:`InvalidDeviceIds`."""
    uuid, sep, number = device_id.rpartition(SEPARATOR)
    n = parse_unit_number(number) if sep and uuid else None
    if n is None:
        raise InvalidDeviceIds(f"{device_id[:80]!r} is not a gpushare device ID (<uuid>::<n>)")
    return uuid, n


@dataclass(frozen=True)
class Card:
    """A card as the plugin advertises it."""

    gpu: Gpu
    memory_units: int

    @property
    def uuid(self) -> str:
        return self.gpu.uuid

    def units(self, resource: Resource) -> int:
        if resource is Resource.MEMORY:
            return self.memory_units
        # A MIG device sliced for memory (migSharing) has no core units: HAMi-core's SM
        # limiter samples the parent card's utilisation, not reported per MIG device.
        return 0 if self.gpu.parent_uuid else CORE_UNITS_PER_CARD


class Inventory:
    """The cards this node advertises, with the unit size; maps IDs to cards and back."""

    def __init__(self, gpus: Iterable[Gpu], memory_unit_mib: int) -> None:
        self.memory_unit_mib = memory_unit_mib
        self.cards: dict[str, Card] = {}
        for gpu in sorted(gpus, key=lambda g: g.index):
            units = gpu.allocatable_mib // memory_unit_mib  # what tenants can really have
            longest = format_device_id(gpu.uuid, max(units, 100))
            if len(longest) > MAX_DEVICE_ID_LENGTH:
                raise ValueError(
                    f"GPU UUID {gpu.uuid} makes device IDs longer than {MAX_DEVICE_ID_LENGTH}"
                )
            self.cards[gpu.uuid] = Card(gpu, units)

    def __len__(self) -> int:
        return len(self.cards)

    def device_ids(self, resource: Resource, uuid: str) -> list[str]:
        return [format_device_id(uuid, n) for n in range(self.cards[uuid].units(resource))]

    def resolve(self, resource: Resource, device_ids: Iterable[str]) -> dict[str, list[int]]:
        """Group IDs by card UUID (in first-seen order), checking every one.

        Raises :class:`InvalidDeviceIds` for an ID that is malformed, names an unknown
        card, is out of the resource's range on its card, or appears twice.
        """
        by_card: dict[str, list[int]] = {}
        seen: set[str] = set()
        for device_id in device_ids:
            uuid, n = parse_device_id(device_id)
            card = self.cards.get(uuid)
            if card is None:
                raise InvalidDeviceIds(f"{device_id[:80]!r} names no GPU on this node")
            if n >= card.units(resource):
                raise InvalidDeviceIds(
                    f"{device_id!r} is not a {resource.value} unit: card {uuid} has "
                    f"{card.units(resource)} (IDs ::0 to ::{card.units(resource) - 1})"
                )
            if device_id in seen:
                raise InvalidDeviceIds(f"{device_id!r} is listed twice")
            seen.add(device_id)
            by_card.setdefault(uuid, []).append(n)
        return by_card

    def free_units(self, resource: Resource, used: Mapping[str, int]) -> dict[str, int]:
        """Free units per card given the used count per card."""
        return {uuid: card.units(resource) - used.get(uuid, 0) for uuid, card in self.cards.items()}
