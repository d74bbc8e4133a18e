"""Kubernetes quantities (``4Gi``, ``500m``, ``1e3``, ``1k``): one reader for all. Pure.

The API server re-emits every quantity in its canonical form: a pod that asks ``1000``
units is read back as ``"1k"``, ``2048`` written as ``2Ki`` stays ``"2Ki"``, ``3000m``
becomes ``"3"``, and a capacity written ``80Gi`` may come back in another spelling. So
what is read is compared by value, never by text: :func:`parse_quantity` gives the exact
value; :func:`whole_units` the whole, non-negative number an extended resource (a count
of units, ``<prefix>/vcuda-memory``, ``<prefix>/gpu``) stands for, as the kubelet, the
scheduler and the admission policies read it.
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
#: The largest quantity Kubernetes represents (int64).
MAX_QUANTITY = (1 << 63) - 1
#: Longer text is no quantity the API server writes (it refuses more digits anyway).
MAX_TEXT = 64


class QuantityError(ValueError):
    """Not a Kubernetes quantity; the message names the text."""


def parse_quantity(text: object) -> Fraction:
    """The exact value of a quantity given as a string (or an int, as YAML may give it)."""
    if isinstance(text, bool):
        raise QuantityError(f"{text!r} is not a quantity")
    if isinstance(text, int):
        return Fraction(text)
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise QuantityError(f"{text!r} is not a quantity")
    match = _QUANTITY.fullmatch(text)
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


def whole_units(value: object) -> int | None:
    """The whole, non-negative number a quantity stands for; None when ``value`` is not
    a quantity, is negative or fractional, or is larger than Kubernetes allows."""
    try:
        number = parse_quantity(value)
    except QuantityError:
        return None
    if number < 0 or number.denominator != 1 or number > MAX_QUANTITY:
        return None
    return int(number)
