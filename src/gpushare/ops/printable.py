"""Strings from the cluster made safe to print on a terminal.

Names, annotations and node state are written by tenants or could be: a value may
carry terminal escape sequences (ESC [ ... that move the cursor, retitle the window
or rewrite earlier lines), carriage returns, bidirectional overrides that reorder what
is shown, or be huge. :func:`printable` shows every such character as an escape
(``\\x1b``, ``\\u202e``) and cuts the text to a bound, so what is printed is what is
there.
"""

from __future__ import annotations

import unicodedata

#: Longest text printed for one value (a Kubernetes name has at most 253 characters).
DEFAULT_LIMIT = 253

#: Categories never printed as themselves: controls, format characters (bidi
#: overrides, zero-width), surrogates, private use, unassigned, line/paragraph separators.
_UNSAFE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(value: object, limit: int = DEFAULT_LIMIT) -> str:
    """``value`` as text with unsafe characters escaped, at most ``limit`` characters
    of the original (then ``...``)."""
    text = str(value)
    cut = len(text) > limit
    text = text[:limit]
    safe = "".join(_escape(c) if unicodedata.category(c) in _UNSAFE else c for c in text)
    return safe + "..." if cut else safe
