"""The thread both extender feeds run: list, then watch from the list's version.

:class:`~gpushare.extender.podfeed.PodFeed` (pods, for the ledger) and
:class:`~gpushare.extender.nodefeed.NodeFeed` (Nodes, for the node cache) differ only in
what they list and what they keep of each object; the thread, its stop, the resume
version, the watch loop (with :mod:`gpushare.kube.watching`'s bookmarks, 410 and
growing delay) and the hand-over to the extender's event loop are this one class.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from gpushare.kube.stdlibclient import ApiClient, Watch
from gpushare.kube.watching import open_watch, raise_if_error, run_until_stopped

PAGE = 500
LIST_TIMEOUT = 30.0
MAX_BACKOFF = 30.0


class ListWatchFeed:
    """One list-then-watch thread over ``path``; subclasses say what a cycle lists
    (:meth:`_cycle`) and what a watch event becomes (:meth:`_watched`)."""

    path = ""
    #: the watch's selectors (the list's are each feed's own)
    watch_query: dict[str, str] = {}
    thread_name = ""
    #: extra fields of the retry loop's log events
    log_fields: dict[str, str] = {}

    def __init__(self, client: ApiClient, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.loop = loop
        self.events = 0  # watch events applied, for tests and metrics
        self.lists = 0
        self._resume = ""
        self._stop = threading.Event()
        self._current: Watch | None = None
        self._thread: threading.Thread | None = None

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on the extender's event loop (what the feed feeds is not
        thread-safe)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        current = self._current
        if current is not None:
            current.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.client.close()

    def _run(self) -> None:
        run_until_stopped(self._stop, self._cycle, self._relist, MAX_BACKOFF, **self.log_fields)

    def _cycle(self) -> None:  # pragma: no cover - every feed has its own
        raise NotImplementedError

    def _watched(self, kind: str, obj: dict[str, Any]) -> None:  # pragma: no cover
        raise NotImplementedError

    def _relist(self) -> None:
        self._resume = ""

    def _watch_once(self) -> None:
        watch = open_watch(self.client, self.path, self.watch_query, self._resume)
        self._current = watch
        try:
            if self._stop.is_set():
                return
            for kind, obj in watch:
                raise_if_error(kind, obj)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._watched(kind, obj)
                version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
                if version:
                    self._resume = version
        finally:
            self._current = None
            watch.close()
