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
from typing import Any

import structlog

from gpushare.extender.feedthread import LIST_TIMEOUT, PAGE, ListWatchFeed
from gpushare.extender.nodecache import NodeCache, NodeRecord, node_name, record_of
from gpushare.kube.stdlibclient import ApiClient

log = structlog.get_logger(__name__)

NODES = "/api/v1/nodes"


class NodeFeed(ListWatchFeed):
    """Feeds ``cache`` from the API server; every cache write happens on ``loop``."""

    path = NODES
    thread_name = "node-feed"
    log_fields = {"feed": "nodes"}

    def __init__(
        self, client: ApiClient, prefix: str, cache: NodeCache, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__(client, loop)
        self.prefix = prefix
        self.cache = cache

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

    def _cycle(self) -> None:
        if not self._resume:
            records, self._resume = self.list_nodes()
            self._call(self._adopt, records)
            log.info("nodes_listed", nodes=len(records))
        self._watch_once()

    def _watched(self, kind: str, obj: dict[str, Any]) -> None:
        name = node_name(obj)
        if name:
            self._call(self._event, kind, name, record_of(obj, self.prefix))
