"""What the DRA driver holds prepared now, in memory: the checkpoint's entries as
:class:`~gpushare.dra.claims.ClaimPreparer` last read or wrote them.

The node's published state and the metrics read it at every publication and scrape:
never a file, never the node lock (held across a whole prepare), only this map's own
short lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gpushare.dra.checkpoint import ClaimEntry


class HeldClaims:
    """Claim UID -> :class:`ClaimEntry`, thread-safe."""

    def __init__(self) -> None:
        self._entries: dict[str, ClaimEntry] = {}
        self._lock = threading.Lock()
        #: Called by :meth:`changed` (after a prepare or unprepare that changed something).
        self.on_change: Callable[[], None] | None = None

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def entries(self) -> list[ClaimEntry]:
        """Every entry, by UID."""
        with self._lock:
            return [self._entries[uid] for uid in sorted(self._entries)]

    def replace_all(self, entries: dict[str, ClaimEntry]) -> None:
        with self._lock:
            self._entries = dict(entries)

    def remember(self, uid: str, entry: ClaimEntry | None) -> bool:
        """Keep (or, with None, drop) ``uid``'s entry; True if that changed anything."""
        with self._lock:
            before = self._entries.get(uid)
            if entry is None:
                self._entries.pop(uid, None)
            else:
                self._entries[uid] = entry
        return before != entry
