"""Per-card overrides: the one syntax of every option that says something of the node
and/or of single cards (``memoryEnforcement: "auto,0=interposer"``, ``cardModes:
"0=exclusive"``, ``timeSliceReplicas: "4,0=8"``). Pure.

A value is a comma-separated list of entries, blanks are spaces, empty entries are
allowed; an entry is ``<value>`` (node-wide, where the option has a node-wide value) or
``<card index or UUID>=<value>``. :func:`overrides_pattern` is the option's regex (in the
shared dialect of :mod:`gpushare.config`, for the chart's schema and the CRD alike) and
:func:`parse_overrides` reads exactly what it accepts, unless something is given twice.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

#: A card as an override names it: its index or its UUID (``GPU-...``).
CARD_KEY = "[A-Za-z0-9_.:-]+"
_KEY = re.compile(CARD_KEY)

T = TypeVar("T")


def any_case(word: str) -> str:
    """A regex matching ``word`` in any letter case, without flags (Go and Python alike)."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in word)


def overrides_pattern(value: str, *, node_wide: bool = True) -> str:
    """The whole option's regex, anchored with ``^``/``$``, for entries whose value
    matches ``value`` (a regex group); without ``node_wide`` every entry names a card."""
    entry = f"({CARD_KEY} *= *)?{value}" if node_wide else f"{CARD_KEY} *= *{value}"
    return f"^ *({entry})?( *, *({entry})?)* *$"


@dataclass(frozen=True)
class Wording:
    """How an option's errors name what it sets: ``value`` in ``<card index or
    UUID>=<value>``, ``values`` in "two node-wide <values>", ``one`` in "card 0 is given
    <one> twice"; ``option``: the option's name, said first (empty: not said)."""

    value: str
    values: str
    one: str
    option: str = ""

    def said(self, text: str) -> str:
        return f"{self.option}: {text}" if self.option else text


def parse_overrides(
    text: str,
    read: Callable[[str, str], T],
    wording: Wording,
    *,
    node_wide: bool = True,
) -> tuple[T | None, dict[str, T]]:
    """(the node-wide value, None when not given; card index or UUID -> its value).
    ``read(entry, value)`` turns one value's text into the value, or raises a one-line
    ValueError naming the entry. ValueError too for a key that is no card index or UUID,
    two node-wide values, or a card named twice."""
    node: T | None = None
    cards: dict[str, T] = {}
    for part in text.split(","):
        part = part.strip(" ")
        if not part:
            continue
        key, sep, value = part.rpartition("=") if node_wide else part.partition("=")
        key, value = key.strip(" "), value.strip(" ")
        not_an_entry = wording.said(f"{part!r} is not <card index or UUID>=<{wording.value}>")
        if not node_wide and (not sep or not _KEY.fullmatch(key)):
            raise ValueError(not_an_entry)
        read_value = read(part, value)
        if not sep:
            if node is not None:
                raise ValueError(
                    wording.said(f"two node-wide {wording.values}, {node} and {read_value}")
                )
            node = read_value
            continue
        if not _KEY.fullmatch(key):
            raise ValueError(not_an_entry)
        if key in cards:
            raise ValueError(wording.said(f"card {key} is given {wording.one} twice"))
        cards[key] = read_value
    return node, cards
