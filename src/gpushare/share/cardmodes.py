"""Which way each card may be offered: ``cardModes``, shared, exclusive or both.

Pure parsing and lookup; :mod:`gpushare.share.exclusion` enforces it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpushare.gpu.gpus import Gpu


def _any_case(word: str) -> str:
    """A regex matching ``word`` in any letter case, without flags (Go and Python alike)."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in word)


_MODE = "(" + "|".join(_any_case(m) for m in ("shared", "exclusive", "both")) + ")"
#: A card as cardModes names it: its index or its UUID (``GPU-...``).
CARD_KEY = "[A-Za-z0-9_.:-]+"
_ENTRY = f"{CARD_KEY} *= *{_MODE}"
#: The whole cardModes value (blanks are spaces; empty entries are allowed). Anchored with
#: ``^``/``$`` in the dialect of :mod:`gpushare.config` (Python reads ``$`` via its matcher).
CARD_MODES_PATTERN = f"^ *({_ENTRY})?( *, *({_ENTRY})?)* *$"
#: Found in a cardModes value that puts some card in exclusive mode.
EXCLUSIVE_ENTRY = f"= *{_any_case('exclusive')} *(,|$)"
_KEY = re.compile(CARD_KEY)


class CardMode(enum.Enum):
    SHARED = "shared"
    EXCLUSIVE = "exclusive"
    BOTH = "both"

    @property
    def shared(self) -> bool:
        return self is not CardMode.EXCLUSIVE

    @property
    def exclusive(self) -> bool:
        return self is not CardMode.SHARED


def parse_card_modes(text: str) -> dict[str, CardMode]:
    """``0=exclusive,GPU-8a1b...=shared`` -> {card index or UUID: mode}.

    Raises ValueError naming the entry that is not ``<index or UUID>=<mode>``.
    Exactly the values :data:`CARD_MODES_PATTERN` matches parse, unless a card is named
    twice (tested both ways).
    """
    modes: dict[str, CardMode] = {}
    for part in text.split(","):
        part = part.strip(" ")
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(" "), value.strip(" ")
        if not sep or not _KEY.fullmatch(key):
            raise ValueError(f"{part!r} is not <card index or UUID>=<mode>")
        try:
            mode = CardMode(value.lower() if value.isascii() else value)
        except ValueError:
            raise ValueError(
                f"{part!r}: mode {value!r} is not one of shared, exclusive, both"
            ) from None
        if key in modes:
            raise ValueError(f"card {key} is given a mode twice")
        modes[key] = mode
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
