"""Reading a request body as JSON with bounds, in time linear in its size.

Everything the scheduler's side sends is treated as hostile: a body may be nested
deeper than Python's recursion limit, carry numbers of thousands of digits or
``NaN``, or not be UTF-8. Each of these is a :class:`BadRequest` (HTTP 400), never
an exception from deeper down. The size itself is bounded by the HTTP layer.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

#: Deepest nesting of arrays and objects accepted. A Node with managedFields nests
#: about 15 levels; 64 leaves room and keeps every later walk far from the
#: recursion limit (json.dumps of the answer included).
MAX_DEPTH = 64

#: Longest number literal accepted (a 64-bit integer has at most 20 characters).
MAX_NUMBER_CHARS = 32

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class BadRequest(ValueError):
    """The request cannot be answered; the message goes back with HTTP 400."""


def nesting_depth(text: str) -> int:
    """Deepest bracket nesting outside string literals (linear, at C speed mostly)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _number(literal: str) -> int | float:
    if len(literal) > MAX_NUMBER_CHARS:
        raise BadRequest(f"a number of {len(literal)} characters is too long")
    if not any(c in literal for c in ".eE"):
        return int(literal)
    value = float(literal)
    if not math.isfinite(value):
        raise BadRequest(f"the number {literal} is out of range")
    return value


def _constant(name: str) -> Any:
    raise BadRequest(f"{name} is not JSON")


def parse_json(raw: bytes) -> Any:
    """The JSON value of ``raw``; a :class:`BadRequest` saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the body is not UTF-8 text: {exc}") from None
    if not text.strip():
        raise BadRequest("the body is empty; expected ExtenderArgs JSON")
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise BadRequest(f"the body nests {depth} levels deep, more than {MAX_DEPTH}")
    try:
        return json.loads(text, parse_int=_number, parse_float=_number, parse_constant=_constant)
    except BadRequest:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise BadRequest(f"the body is not JSON: {exc}") from None
