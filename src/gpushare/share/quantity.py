"""Kubernetes quantities (``4Gi``, ``500m``, ``1e3``) as exact fractions. Pure.

The API server writes quantities in its canonical form (``80Gi``, ``30``), which is not
always the form a client sent, so what is read back is compared by value, never by text.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<exponent>[eE][+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)"
)
MIB = 1 << 20


class QuantityError(ValueError):
    """Not a Kubernetes quantity; the message names the text."""


def parse_quantity(text: object) -> Fraction:
    """The exact value of a quantity given as a string (or an int, as YAML may give it)."""
    if isinstance(text, bool):
        raise QuantityError(f"{text!r} is not a quantity")
    if isinstance(text, int):
        return Fraction(text)
    if not isinstance(text, str) or len(text) > 64:
        raise QuantityError(f"{text!r} is not a quantity")
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        raise QuantityError(f"{text!r} is not a quantity")
    value = Fraction(match["number"])
    if match["exponent"]:
        power = int(match["exponent"][1:])
        if abs(power) > 30:
            raise QuantityError(f"{text!r}: exponent out of range")
        return value * Fraction(10) ** power
    suffix = match["suffix"] or ""
    return value * (_BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix])


def mebibytes(mib: int) -> str:
    """``<mib>Mi``: how memory capacities are written."""
    return f"{mib}Mi"
