"""A Kubernetes quantity as a whole number of units, the way the API server writes it.

Extended resources (``<prefix>/vcuda-memory``, ``<prefix>/gpu``, ...) must be whole
numbers, but the API server re-emits every quantity in its canonical form: a pod that
asks ``1000`` units is read back as ``"1k"``, ``2048`` written as ``2Ki`` stays
``"2Ki"``, ``3000m`` becomes ``"3"``. The kubelet, the scheduler and the admission
policies all read the number, so the daemon's pod specs and the extender must too:
:func:`whole_units` is the one reading they all share (pure, no I/O).
"""

from __future__ import annotations

import re
from fractions import Fraction

#: The largest quantity Kubernetes represents (int64).
MAX_QUANTITY = (1 << 63) - 1
#: Longer text is no quantity the API server writes (it refuses more digits anyway).
MAX_TEXT = 64

_SUFFIX: dict[str, Fraction] = {
    "": Fraction(1),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(1 << 10),
    "Mi": Fraction(1 << 20),
    "Gi": Fraction(1 << 30),
    "Ti": Fraction(1 << 40),
    "Pi": Fraction(1 << 50),
    "Ei": Fraction(1 << 60),
}
_QUANTITY = re.compile(
    r"\+?(?P<whole>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)|[eE](?P<exp>[+-]?[0-9]{1,3}))?"
)


def whole_units(value: object) -> int | None:
    """The whole, non-negative number a quantity stands for; None when ``value`` is not
    a quantity, is negative or fractional, or is larger than Kubernetes allows."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value <= MAX_QUANTITY else None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        return None
    match = _QUANTITY.fullmatch(value)
    if match is None or not (match["whole"] or match["frac"]):
        return None
    number = Fraction(int(match["whole"] or "0"))
    if match["frac"]:
        number += Fraction(int(match["frac"]), 10 ** len(match["frac"]))
    if match["exp"] is not None:
        number *= Fraction(10) ** int(match["exp"])
    else:
        number *= _SUFFIX[match["suffix"] or ""]
    if number.denominator != 1 or number > MAX_QUANTITY:
        return None
    return int(number)
