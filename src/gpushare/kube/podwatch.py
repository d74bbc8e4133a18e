"""Keeps the :class:`~gpushare.kube.podspecs.PodSpecBook` of this node's pods current.

One thread lists the pods bound to the node, then watches them from the list's
``resourceVersion`` (with bookmarks, so a quiet watch still moves forward), and resumes
from the last version seen when the server ends a watch. A 410 Gone (history
compacted) lists again; any other failure is retried with a growing delay. Between
events the thread sleeps in a socket read: no wake-ups while nothing changes.

:meth:`PodWatch.refresh_now` is the on-demand list the placement asks for when a
request matches no known pod; the watch then resumes from that list's version, so an
older event can never overwrite what the list showed.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from gpushare.kube.kubeclient import ApiClient, ApiStatusError, Watch
from gpushare.kube.podspecs import PodSpecBook

log = structlog.get_logger(__name__)

PODS = "/api/v1/pods"
LIST_TIMEOUT = 5.0
#: The server ends each watch after a random time in this range (seconds), as client-go does.
WATCH_SECONDS = (300, 600)
#: A watch that sent nothing for this long past its own end is taken as dead.
READ_GRACE = 60.0
MAX_BACKOFF = 60.0
ON_DEMAND_TIMEOUT = 1.0
ON_DEMAND_MIN_INTERVAL = 0.2


class Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


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
        #: Called with every pod of the node after each list and each event.
        self.on_pods: Callable[[list[dict[str, Any]]], None] | None = None

    @property
    def query(self) -> dict[str, str]:
        return {"fieldSelector": f"spec.nodeName={self.node_name}"}

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
        answer = api.get(PODS, timeout=timeout, **self.query)
        items = [item for item in answer.get("items") or [] if isinstance(item, dict)]
        with self._lock:
            specs: list[Mapping[str, Any]] = list(items)
            self.book.replace_all(specs)
            self._epoch += 1
            self._resume = _version(answer)
            self._objects = {_uid(item): item for item in items}
            self._tell()
        self.listed.set()
        log.debug("pods_listed", node=self.node_name, pods=len(items))

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

    def _tell(self) -> None:
        """Hand every pod of the node to ``on_pods`` (lock held: calls stay in order)."""
        if self.on_pods is not None:
            self.on_pods(list(self._objects.values()))

    # ------------------------------------------------------------------ watch
    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                api = self._client()
                if api is None:
                    raise ConnectionError("no API endpoint yet")
                if not self._resume:
                    self._list(api, LIST_TIMEOUT)
                self._watch_once(api)
                backoff = 1.0
            except Gone:
                log.info("pod_watch_expired", node=self.node_name)
                with self._lock:
                    self._resume = ""
            except Exception as exc:
                if self._stop.is_set():
                    break
                log.warning("pod_watch_failed", error=str(exc)[:300], retry_seconds=backoff)
                if self._stop.wait(backoff * random.uniform(0.8, 1.2)):
                    break
                backoff = min(backoff * 2, MAX_BACKOFF)

    def _watch_once(self, api: ApiClient) -> None:
        with self._lock:
            epoch, since = self._epoch, self._resume
        seconds = random.randint(*WATCH_SECONDS)
        query = {
            **self.query,
            "resourceVersion": since,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(seconds),
        }
        try:
            watch = api.watch(PODS, query, read_timeout=seconds + READ_GRACE)
        except ApiStatusError as exc:
            if exc.status == 410:
                raise Gone() from None
            raise
        self._current = watch
        try:
            if self._stop.is_set():
                return
            for kind, obj in watch:
                if not self._apply(epoch, kind, obj):
                    return
        finally:
            self._current = None
            watch.close()

    def _apply(self, epoch: int, kind: str, obj: dict[str, Any]) -> bool:
        """Apply one event; False when the watch must end (a list came in between)."""
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise ApiStatusError(int(obj.get("code") or 500), str(obj.get("reason") or ""), "")
        with self._lock:
            if self._epoch != epoch:
                return False  # resume from the newer list's version
            if kind in ("ADDED", "MODIFIED"):
                self.book.update(obj)
                self._objects[_uid(obj)] = obj
            elif kind == "DELETED":
                self.book.remove(_uid(obj))
                self._objects.pop(_uid(obj), None)
            if kind != "BOOKMARK":
                self._tell()
            version = _version(obj)
            if version:
                self._resume = version
        return True
