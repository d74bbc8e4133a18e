"""The extender's watch of the cluster's Nodes: each node's published cards, by name.

Like the pod feed (:mod:`gpushare.extender.podfeed`), one thread lists the Nodes in
pages, then watches from the list's ``resourceVersion`` with the shared pieces of
:mod:`gpushare.kube.watching` (bookmarks, resume, 410 lists again, growing delay after
failures). Each Node is reduced at once to a :class:`~gpushare.extender.nodecache.NodeRecord`
(its card state decoded, or why there is none) and handed to the cache on the
extender's event loop; the full object is dropped. Until the first list is read a
filter by names keeps no node (it could not say which cards are free).

It needs ``list`` and ``watch`` on nodes (kube-scheduler's own ClusterRole has them;
the kubeadm extender's role grants them).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import structlog

from gpushare.extender.nodecache import NodeCache, NodeRecord, node_name, record_of
from gpushare.kube.stdlibclient import ApiClient, Watch
from gpushare.kube.watching import open_watch, raise_if_error, run_until_stopped

log = structlog.get_logger(__name__)

NODES = "/api/v1/nodes"
PAGE = 500
LIST_TIMEOUT = 30.0
MAX_BACKOFF = 30.0


class NodeFeed:
    """Feeds ``cache`` from the API server; every cache write happens on ``loop``."""

    def __init__(
        self, client: ApiClient, prefix: str, cache: NodeCache, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.cache = cache
        self.loop = loop
        self.events = 0  # watch events applied, for tests
        self.lists = 0
        self._resume = ""
        self._stop = threading.Event()
        self._current: Watch | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ on the loop
    def _adopt(self, records: dict[str, NodeRecord]) -> None:
        self.cache.replace_all(records)
        self.lists += 1

    def _event(self, kind: str, name: str, record: NodeRecord) -> None:
        if kind == "DELETED":
            self.cache.drop(name)
        else:
            self.cache.put(name, record)
        self.events += 1

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ in the thread
    def list_nodes(self) -> tuple[dict[str, NodeRecord], str]:
        """Every node, page by page: (name -> record, the list's resourceVersion)."""
        records: dict[str, NodeRecord] = {}
        token = ""
        while True:
            query = {"limit": str(PAGE)}
            if token:
                query["continue"] = token
            answer = self.client.get(NODES, timeout=LIST_TIMEOUT, **query)
            for item in answer.get("items") or []:
                name = node_name(item) if isinstance(item, dict) else ""
                if name:
                    records[name] = record_of(item, self.prefix)
            meta = answer.get("metadata") or {}
            token = str(meta.get("continue") or "")
            if not token:
                return records, str(meta.get("resourceVersion") or "")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="node-feed", daemon=True)
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
        run_until_stopped(self._stop, self._cycle, self._relist, MAX_BACKOFF, feed="nodes")

    def _cycle(self) -> None:
        if not self._resume:
            records, self._resume = self.list_nodes()
            self._call(self._adopt, records)
            log.info("nodes_listed", nodes=len(records))
        self._watch_once()

    def _relist(self) -> None:
        self._resume = ""

    def _watch_once(self) -> None:
        watch = open_watch(self.client, NODES, {}, self._resume)
        self._current = watch
        try:
            if self._stop.is_set():
                return
            for kind, obj in watch:
                raise_if_error(kind, obj)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    name = node_name(obj)
                    if name:
                        self._call(self._event, kind, name, record_of(obj, self.prefix))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
                if version:
                    self._resume = version
        finally:
            self._current = None
            watch.close()
