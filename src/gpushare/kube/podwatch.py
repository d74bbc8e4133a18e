"""Keeps the :class:`~gpushare.kube.podspecs.PodSpecBook` of this node's pods current.

One thread lists the live pods bound to the node (terminal ones are left out by the
field selector ``status.phase!=...``), in pages (``limit``/``continue``) read one
item at a time (``jsonstream``), each pod reduced at once to the few fields the daemon
reads (``podslim``; non-GPU and terminal pods are dropped), then watches them from the list's
``resourceVersion`` (with bookmarks, so a quiet watch still moves forward), and resumes
from the last version seen when the server ends a watch. A 410 Gone (history
compacted) lists again; any other failure is retried with a growing delay. Between
events the thread sleeps in a socket read: no wake-ups while nothing changes.

:meth:`PodWatch.refresh_now` is the on-demand list the placement asks for when a
request matches no known pod; the watch then resumes from that list's version, so an
older event can never overwrite what the list showed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from gpushare.kube.podslim import claim_view, slim
from gpushare.kube.podspecs import PodSpecBook
from gpushare.kube.stdlibclient import ApiClient, Watch
from gpushare.kube.watching import open_watch, raise_if_error, run_until_stopped

log = structlog.get_logger(__name__)

PODS = "/api/v1/pods"
LIST_TIMEOUT = 5.0
MAX_BACKOFF = 60.0
ON_DEMAND_TIMEOUT = 1.0
ON_DEMAND_MIN_INTERVAL = 0.2
#: Pods per list page (client-go's pager uses 500); memory does not depend on it, as
#: items are read one at a time.
PAGE_LIMIT = 250


def _uid(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


def _version(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class PodWatch:
    def __init__(
        self, client: Callable[[], ApiClient | None], node_name: str, book: PodSpecBook
    ) -> None:
        self._client = client  # None while the API link has no endpoint yet
        self.node_name = node_name
        self.book = book
        self.listed = threading.Event()  # set after the first list
        self._lock = threading.Lock()  # orders a list against the watch's events
        self._epoch = 0  # bumped by every list: a watch from before it stops applying
        self._resume = ""  # resourceVersion to watch from; "" = list first
        self._last_on_demand = float("-inf")
        self._stop = threading.Event()
        self._current: Watch | None = None
        self._thread: threading.Thread | None = None
        self._objects: dict[str, dict[str, Any]] = {}  # this node's pods as listed, by uid
        #: this node's pods that use ResourceClaims, by uid: which claims each container
        #: uses (``podslim.claim_view``), for the DRA driver (:meth:`claim_pod`)
        self._claim_pods: dict[str, dict[str, Any]] = {}
        #: Called with every pod of the node after each list and each event.
        self.on_pods: Callable[[list[dict[str, Any]]], None] | None = None

    @property
    def query(self) -> dict[str, str]:
        return {
            "fieldSelector": f"spec.nodeName={self.node_name},"
            "status.phase!=Succeeded,status.phase!=Failed"
        }

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        current = self._current
        if current is not None:
            current.close()
        if self._thread is not None:
            self._thread.join(timeout=LIST_TIMEOUT + 1)

    # ------------------------------------------------------------------ list
    def _list(self, api: ApiClient, timeout: float) -> None:
        kept: dict[str, dict[str, Any]] = {}
        claim_pods: dict[str, dict[str, Any]] = {}
        seen, token, version = 0, "", ""
        while True:
            query = {**self.query, "limit": str(PAGE_LIMIT)}
            if token:
                query["continue"] = token
            with api.stream_list(PODS, query, timeout) as stream:
                for item in stream.items():
                    seen += 1
                    pod = slim(item, self.book.prefix) if isinstance(item, dict) else None
                    view = claim_view(item) if isinstance(item, dict) else None
                    del item  # the full object goes now, before the next one is read
                    if pod is not None and _uid(pod):
                        kept[_uid(pod)] = pod
                    if view is not None and _uid(view):
                        claim_pods[_uid(view)] = view
                meta = stream.fields.get("metadata")
            meta = meta if isinstance(meta, dict) else {}
            version = str(meta.get("resourceVersion") or version)
            token = str(meta.get("continue") or "")
            if not token:
                break
        with self._lock:
            specs: list[Mapping[str, Any]] = list(kept.values())
            self.book.replace_all(specs)
            self._epoch += 1
            self._resume = version
            self._objects = kept
            self._claim_pods = claim_pods
            self._tell()
        self.listed.set()
        log.debug("pods_listed", node=self.node_name, pods=seen, kept=len(kept))

    def refresh_now(self) -> bool:
        """List this node's pods now (bounded and rate-limited); True if it did."""
        api = self._client()
        now = time.monotonic()
        if api is None or now - self._last_on_demand < ON_DEMAND_MIN_INTERVAL:
            return False
        self._last_on_demand = now
        try:
            self._list(api, ON_DEMAND_TIMEOUT)
        except Exception as exc:
            log.warning("pod_list_failed", error=str(exc)[:300])
            return False
        return True

    def claim_pod(self, uid: str) -> dict[str, Any] | None:
        """The pod ``uid`` of this node, as far as the ResourceClaims its containers use
        (``podslim.claim_view``), as the watch last saw it; None when the watch does not
        hold it (not listed yet, not on this node, ended or gone, or past the bounds).
        Without the watch's lock (a prepare never waits for the listeners it calls): one
        lookup in a dict that a list replaces whole and an event changes by one key."""
        return self._claim_pods.get(uid)

    def _tell(self) -> None:
        """Hand every pod of the node to ``on_pods`` (lock held: calls stay in order)."""
        if self.on_pods is not None:
            self.on_pods(list(self._objects.values()))

    # ------------------------------------------------------------------ watch
    def _run(self) -> None:
        run_until_stopped(self._stop, self._cycle, self._relist, MAX_BACKOFF, node=self.node_name)

    def _cycle(self) -> bool:
        """One list if needed and one watch; True when a list of ours ended the watch."""
        api = self._client()
        if api is None:
            raise ConnectionError("no API endpoint yet")
        if not self._resume:
            self._list(api, LIST_TIMEOUT)
        return self._watch_once(api)

    def _relist(self) -> None:
        with self._lock:
            self._resume = ""

    def _watch_once(self, api: ApiClient) -> bool:
        with self._lock:
            epoch, since = self._epoch, self._resume
        watch = open_watch(api, PODS, self.query, since)
        self._current = watch
        try:
            if self._stop.is_set():
                return False
            # True: a list came in between (resume from its version now)
            return any(not self._apply(epoch, kind, obj) for kind, obj in watch)
        finally:
            self._current = None
            watch.close()

    def _apply(self, epoch: int, kind: str, obj: dict[str, Any]) -> bool:
        """Apply one event; False when the watch must end (a list came in between)."""
        raise_if_error(kind, obj)
        with self._lock:
            if self._epoch != epoch:
                return False  # resume from the newer list's version
            version, uid = _version(obj), _uid(obj)
            pod = slim(obj, self.book.prefix) if kind in ("ADDED", "MODIFIED") else None
            view = claim_view(obj) if kind in ("ADDED", "MODIFIED") else None
            obj.clear()  # the full object goes now: only ``pod`` and ``view`` are kept
            if view is not None and uid:
                self._claim_pods[uid] = view
            elif kind != "BOOKMARK" and uid:
                self._claim_pods.pop(uid, None)
            if pod is not None and uid:
                self.book.update(pod)
                self._objects[uid] = pod
            elif kind != "BOOKMARK" and uid:
                # Deleted, terminal, or asking for no GPU: forgotten at once.
                self.book.remove(uid)
                self._objects.pop(uid, None)
            if kind != "BOOKMARK":
                self._tell()
            if version:
                self._resume = version
        return True
