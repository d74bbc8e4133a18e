"""The extender's watch of the nodes' state objects (ConfigMaps ``gpushare-node-<node>``).

The daemons publish their card state in one ConfigMap per node in their namespace
(:mod:`gpushare.kube.stateobject`); this feed lists and watches those (label
``<prefix>/node-state=true``, in that one namespace) with the same thread as the other
feeds (:mod:`gpushare.extender.feedthread`) and hands each, decoded and checked, to the
:class:`~gpushare.extender.nodecache.NodeCache`, which prefers it to the Node annotation
of the same node. An object is believed only if it is self-consistent (its name, the
node it names and its owner agree; :func:`~gpushare.kube.stateobject.read_state_object`)
and, once the node feed has seen the Node, owned by that Node's UID.

It needs ``list`` and ``watch`` on configmaps in that namespace (a Role). Without them
(an extender upgraded before its RBAC) the feed reports it, counts as listed with no
objects, and keeps retrying: the cache then reads every node's annotation, as older
extenders do, which daemons in mode ``both`` still write.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from gpushare.extender.feedthread import LIST_TIMEOUT, PAGE, ListWatchFeed
from gpushare.extender.nodecache import NodeCache, StateRecord, state_record_of
from gpushare.kube import stateobject
from gpushare.kube.stdlibclient import ApiClient, ApiStatusError

log = structlog.get_logger(__name__)


class StateFeed(ListWatchFeed):
    """Feeds ``cache`` the state objects of ``namespace``; cache writes on ``loop``."""

    thread_name = "state-feed"
    log_fields = {"feed": "node-state"}

    def __init__(
        self,
        client: ApiClient,
        prefix: str,
        namespace: str,
        cache: NodeCache,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(client, loop)
        self.prefix = prefix
        self.cache = cache
        self.path = stateobject.configmaps_path(namespace)
        self.watch_query = {"labelSelector": stateobject.selector(prefix)}
        self.forbidden = False

    # ------------------------------------------------------------------ on the loop
    def _adopt(self, records: dict[str, StateRecord]) -> None:
        self.cache.replace_objects(records)
        self.lists += 1

    def _event(self, kind: str, record: StateRecord) -> None:
        if kind == "DELETED":
            self.cache.drop_object(record.node, record.name)
        else:
            self.cache.put_object(record)
        self.events += 1

    # ------------------------------------------------------------------ in the thread
    def list_objects(self) -> tuple[dict[str, StateRecord], str]:
        """Every state object, page by page: (node -> record, the list's version)."""
        records: dict[str, StateRecord] = {}
        token = ""
        while True:
            query = {"limit": str(PAGE), **self.watch_query}
            if token:
                query["continue"] = token
            answer = self.client.get(self.path, timeout=LIST_TIMEOUT, **query)
            for item in answer.get("items") or []:
                if isinstance(item, dict):
                    record = state_record_of(item, self.prefix)
                    if record.node:
                        records[record.node] = record
            meta = answer.get("metadata") or {}
            token = str(meta.get("continue") or "")
            if not token:
                return records, str(meta.get("resourceVersion") or "")

    def _cycle(self) -> None:
        if not self._resume:
            try:
                records, self._resume = self.list_objects()
            except ApiStatusError as exc:
                if exc.status in (403, 404) and not self.forbidden:
                    # No RBAC for the objects yet (or a stand-in that serves none):
                    # read the annotations meanwhile.
                    self.forbidden = True
                    log.warning(
                        "node_state_objects_forbidden",
                        path=self.path,
                        status=exc.status,
                        fallback="the Node annotations",
                    )
                    self._call(self.cache.objects_unreadable)
                raise
            self.forbidden = False
            self._call(self._adopt, records)
            log.info("node_state_objects_listed", objects=len(records))
        self._watch_once()

    def _watched(self, kind: str, obj: dict[str, Any]) -> None:
        record = state_record_of(obj, self.prefix)
        if record.node:
            self._call(self._event, kind, record)
