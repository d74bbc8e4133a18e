"""Which way each card may be offered: ``cardModes``, shared, exclusive, both, dra or
timeslice (``timeSliceReplicas`` replicas of ``<prefix>/gpu.shared``, no limits).

Pure parsing and lookup; :mod:`gpushare.share.exclusion` enforces it. A card in ``dra``
mode is in none of the device plugin's lists: the DRA driver (:mod:`gpushare.dra`)
publishes it in the node's ResourceSlice instead.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from gpushare.share.cardoverrides import Wording, any_case, overrides_pattern, parse_overrides

if TYPE_CHECKING:
    from gpushare.gpu.gpus import Gpu


_MODE = (
    "(" + "|".join(any_case(m) for m in ("shared", "exclusive", "both", "dra", "timeslice")) + ")"
)
#: The whole cardModes value: ``<card index or UUID>=<mode>`` entries, no node-wide one
#: (:mod:`gpushare.share.cardoverrides`; Python reads ``$`` via the config's matcher).
CARD_MODES_PATTERN = overrides_pattern(_MODE, node_wide=False)
#: Found in a cardModes value that puts some card in exclusive mode.
EXCLUSIVE_ENTRY = f"= *{any_case('exclusive')} *(,|$)"


class CardMode(enum.Enum):
    SHARED = "shared"
    EXCLUSIVE = "exclusive"
    BOTH = "both"
    DRA = "dra"
    TIMESLICE = "timeslice"

    @property
    def shared(self) -> bool:
        """Offered as the device plugin's memory and core units."""
        return self in (CardMode.SHARED, CardMode.BOTH)

    @property
    def exclusive(self) -> bool:
        """Offered whole by the device plugin."""
        return self in (CardMode.EXCLUSIVE, CardMode.BOTH)


def parse_card_modes(text: str) -> dict[str, CardMode]:
    """``0=exclusive,GPU-8a1b...=shared`` -> {card index or UUID: mode}.

    Raises ValueError naming the entry that is not ``<index or UUID>=<mode>``.
    Exactly the values :data:`CARD_MODES_PATTERN` matches parse, unless a card is named
    twice (tested both ways).
    """

    def mode(part: str, value: str) -> CardMode:
        try:
            return CardMode(value.lower() if value.isascii() else value)
        except ValueError:
            raise ValueError(
                f"{part!r}: mode {value!r} is not one of shared, exclusive, both, dra, timeslice"
            ) from None

    _node, modes = parse_overrides(text, mode, Wording("mode", "modes", "a mode"), node_wide=False)
    return modes


def card_modes(gpus: Iterable[Gpu], spec: Mapping[str, CardMode]) -> dict[str, CardMode]:
    """Each card's mode (by UUID); a card named by both index and UUID takes the UUID's.

    Raises ValueError for a key that names no card of this node (a typo must not
    silently leave a card in the wrong pool).
    """
    gpus = list(gpus)
    known = {str(g.index) for g in gpus} | {g.uuid for g in gpus}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"cardModes names no GPU of this node: {', '.join(unknown)}")
    return {gpu.uuid: spec.get(gpu.uuid, spec.get(str(gpu.index), CardMode.BOTH)) for gpu in gpus}


def dra_cards(gpus: Iterable[Gpu], modes: Mapping[str, CardMode]) -> list[Gpu]:
    """The cards the DRA driver publishes (mode ``dra``), in the order given."""
    return [g for g in gpus if modes.get(g.uuid) is CardMode.DRA]


# --------------------------------------------------------------------------- time slicing

#: The most replicas one card may offer (each replica is a device of the kubelet's list).
MAX_REPLICAS = 64
_COUNT = "([1-9]|[1-5][0-9]|6[0-4])"
#: ``timeSliceReplicas``: a node-wide count and/or ``<card>=<count>``, comma-separated.
REPLICAS_PATTERN = overrides_pattern(_COUNT)


def parse_replicas(text: str) -> tuple[int | None, dict[str, int]]:
    """``4,0=8`` -> (4, {"0": 8}): the node-wide count (None: not given) and per card.
    ValueError (one line) for a count outside 1..64, a bad key, two node-wide counts or
    a card named twice."""

    def count(part: str, value: str) -> int:
        if not value.isdigit() or not 1 <= int(value) <= MAX_REPLICAS:
            raise ValueError(f"{part!r}: {value!r} is not a count of replicas from 1 to 64")
        return int(value)

    return parse_overrides(text, count, Wording("replicas", "replica counts", "replicas"))


def replicas_for(gpu: Gpu, text: str, default: int = 4) -> int:
    """How many replicas card ``gpu`` offers in mode timeslice."""
    node, cards = parse_replicas(text)
    return cards.get(gpu.uuid, cards.get(str(gpu.index), node if node is not None else default))


def timeslice_cards(gpus: Iterable[Gpu], modes: Mapping[str, CardMode]) -> list[Gpu]:
    """The cards offered as time-sliced replicas (mode ``timeslice``), in the order given."""
    return [g for g in gpus if modes.get(g.uuid) is CardMode.TIMESLICE]
