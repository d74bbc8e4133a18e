"""What the modules the single-file kubectl plugin shares with the daemon need from
Python 3.10+ and 3.11, for Python 3.9 (``make kubectl-plugin`` runs there; the daemon
itself needs 3.11)."""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable, Iterator
from typing import Any

if sys.version_info >= (3, 11):  # noqa: UP036 - the plugin runs on 3.9
    from enum import StrEnum
else:  # pragma: no cover - Python 3.9 and 3.10

    class StrEnum(str, enum.Enum):  # noqa: UP042
        """An enum whose members are strings and print as their value."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


def zip_strict(*iterables: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """``zip(..., strict=True)``: ValueError when the lengths differ."""
    lists = [list(items) for items in iterables]
    if len({len(items) for items in lists}) > 1:
        raise ValueError("zip_strict: arguments have different lengths")
    return zip(*lists)  # noqa: B905 - lengths checked above


__all__ = ["StrEnum", "zip_strict"]
