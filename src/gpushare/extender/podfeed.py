"""The extender's watch of the cluster's pods: who is bound where, and who ended.

One thread lists every pod (in pages), then watches from the list's
``resourceVersion`` (with bookmarks), and resumes from the last version seen when the
server ends a watch; a 410 Gone lists again, any other failure is retried with a
growing delay. Of each pod it keeps only what the ledger uses (``PodFacts``: UID,
name, node, the gpushare containers' units, whether it ended), and it hands every
change to the ledger on the extender's event loop (the ledger is not thread-safe).
Pods asking for no gpushare resource are dropped at once.

The first list is read by the feed's thread, and the extender waits for it before it
serves (for up to :data:`START_LIST_SECONDS`); past that it serves while the same list
goes on (a second list is never started beside a slow first one: at 150 000 pods that
doubled both the time and the memory). Until a list has been read the filter keeps no
node (``AdmissionLedger.awaiting_list``), so a restarted extender never counts a node
as if no pod were bound to it. The list is read as a stream (one pod at a time,
reduced to its facts before the next is parsed), so memory holds one page's text at
most, not the whole answer.

It needs ``list`` and ``watch`` on pods (kube-scheduler's own ClusterRole has them;
the kubeadm extender's role grants them).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

from gpushare._proto.kubeapi.v1 import pods_pb2
from gpushare.extender.feedthread import LIST_TIMEOUT, PAGE, ListWatchFeed
from gpushare.extender.fit import PodSpecError, pod_need
from gpushare.extender.ledger import AdmissionLedger, PodFacts
from gpushare.kube.nodestate import decode_plan, plan_annotation_key
from gpushare.kube.protolist import PROTOBUF_OR_JSON, ProtoListStream, pod_object, quantity_names
from gpushare.kube.stdlibclient import ApiClient, Endpoint

log = structlog.get_logger(__name__)

PODS = "/api/v1/pods"
#: How long the extender waits for the first list before it serves anyway.
START_LIST_SECONDS = 10.0
TERMINAL = frozenset({"Succeeded", "Failed"})


def endpoint_of(url: str, token_file: str, ca_file: str) -> Endpoint:
    """The API server at ``url`` with the extender's token and CA."""
    parts = urlsplit(url)
    scheme = parts.scheme or "https"
    context = ssl.create_default_context(cafile=ca_file or None) if scheme == "https" else None
    host = (parts.hostname or "").strip("[]")
    port = parts.port or (443 if scheme == "https" else 80)
    token = Path(token_file) if token_file else None
    return Endpoint(scheme, host, port, parts.path.rstrip("/"), context, token_file=token)


def _may_matter(pod: Mapping[str, Any], prefix: str) -> bool:
    """False only for a running or pending pod that names no ``prefix`` resource in any
    container (most of a cluster's pods): the cheap test before :func:`facts_of`."""
    status = pod.get("status")
    phase = status.get("phase") if isinstance(status, Mapping) else None
    return _matters(phase, _quantity_names(pod), prefix)


def _matters(phase: object, names: Iterable[object], prefix: str) -> bool:
    """The rule of :func:`_may_matter`, over a pod's phase and the names in its
    containers' limits and requests (read from JSON or protobuf)."""
    if phase in TERMINAL:
        return True
    marker = prefix + "/"
    return any(isinstance(name, str) and name.startswith(marker) for name in names)


def _quantity_names(pod: Mapping[str, Any]) -> Iterator[object]:
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return
    for key in ("containers", "initContainers"):
        containers = spec.get(key)
        if not isinstance(containers, list):
            continue
        for container in containers:
            resources = container.get("resources") if isinstance(container, Mapping) else None
            if not isinstance(resources, Mapping):
                continue
            for amounts in resources.values():
                if isinstance(amounts, Mapping):
                    yield from amounts


def facts_of(pod: Mapping[str, Any], prefix: str) -> PodFacts:
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return PodFacts("", "", "", None, False)
    try:
        need = pod_need(pod, prefix)
    except PodSpecError:
        need = None
    if need is not None and not need.wants_gpu:
        need = None
    phase = status.get("phase") if isinstance(status, Mapping) else None
    annotations = meta.get("annotations")
    text = (
        annotations.get(plan_annotation_key(prefix)) if isinstance(annotations, Mapping) else None
    )
    key = f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"[:320]
    return PodFacts(
        uid=str(meta.get("uid") or "")[:253],
        key=key,
        node=str(spec.get("nodeName") or "")[:253],
        need=need,
        ended=phase in TERMINAL,
        plan=tuple(sorted(decode_plan(text).items())),
    )


class PodFeed(ListWatchFeed):
    """Feeds ``ledger`` from the API server; call every ledger method on ``loop``."""

    path = PODS
    thread_name = "pod-feed"

    def __init__(
        self,
        client: ApiClient,
        prefix: str,
        ledger: AdmissionLedger,
        loop: asyncio.AbstractEventLoop,
        on_first_list: Callable[[], None] | None = None,
    ) -> None:
        """``on_first_list``: called on ``loop`` once the first list is in the ledger,
        however long it took."""
        super().__init__(client, loop)
        self.prefix = prefix
        self.ledger = ledger
        self.on_first_list = on_first_list
        self._plan_keys = (plan_annotation_key(prefix),)  # the annotation a pod's facts keep
        self._listed: asyncio.Event | None = None
        #: how the API server answered the last list: "protobuf" or "json"
        self.encoding = ""

    # ------------------------------------------------------------------ on the loop
    def _adopt(self, listed: list[PodFacts]) -> None:
        self.ledger.pods_listed(listed)
        self.ledger.watching = True
        self.ledger.awaiting_list = False
        self.lists += 1
        if self.lists == 1 and self.on_first_list is not None:
            self.on_first_list()
        if self._listed is not None:
            self._listed.set()

    def _event(self, kind: str, facts: PodFacts) -> None:
        if kind == "DELETED":
            self.ledger.pod_deleted(facts.uid, facts.key, facts.node)
        else:
            self.ledger.pod_seen(facts)
        self.events += 1

    # ------------------------------------------------------------------ in the thread
    def list_pods(self) -> tuple[list[PodFacts], str]:
        """Every pod, page by page, read as a stream: (their facts, the list's
        resourceVersion). Each pod is reduced to its facts (or dropped) before the next
        one is parsed.

        Asked as kube-scheduler's own informers ask: in protobuf (JSON where the server
        does not speak it) and from the API server's watch cache (``resourceVersion=0``:
        any recent version, which the watch from the list's version then brings up to
        date). kube-apiserver v1.36.3 with 150 000 pods listed them in 3.8 s that way
        and in 17 to 22 s as consistent pages of 500 from etcd (each page cost ~60 ms
        there whatever its size)."""
        listed: list[PodFacts] = []
        token = ""
        while True:
            query = {"limit": str(PAGE)}
            if token:
                query["continue"] = token
            else:
                query["resourceVersion"] = "0"
            with self.client.stream_list_as(PODS, query, LIST_TIMEOUT, PROTOBUF_OR_JSON) as stream:
                self.encoding = "protobuf" if isinstance(stream, ProtoListStream) else "json"
                if isinstance(stream, ProtoListStream):
                    for raw in stream.items():
                        self._keep_proto(raw, listed)
                    token, version = stream.continue_token, stream.resource_version
                else:
                    for item in stream.items():
                        if isinstance(item, dict) and _may_matter(item, self.prefix):
                            self._keep(item, listed)
                        del item  # the full object goes before the next is read
                    meta = stream.fields.get("metadata")
                    meta = meta if isinstance(meta, dict) else {}
                    token = str(meta.get("continue") or "")
                    version = str(meta.get("resourceVersion") or "")
            if not token:
                return listed, version

    def _keep_proto(self, raw: bytes, listed: list[PodFacts]) -> None:
        pod = pods_pb2.Pod.FromString(raw)
        if _matters(pod.status.phase, quantity_names(pod), self.prefix):
            self._keep(pod_object(pod, self._plan_keys, self.prefix + "/"), listed)

    def _keep(self, pod: dict[str, Any], listed: list[PodFacts]) -> None:
        facts = facts_of(pod, self.prefix)
        if facts.uid and (facts.need is not None or facts.ended):
            listed.append(facts)

    async def first_list(self, seconds: float | None = None) -> bool:
        """Start the feed (its thread lists first) and wait up to ``seconds`` for that
        list; False if it is not read by then: the extender serves, the filter waits
        (``awaiting_list``), and the same list goes on (no second one)."""
        seconds = START_LIST_SECONDS if seconds is None else seconds
        self.ledger.awaiting_list = True
        self._listed = asyncio.Event()
        self.start()
        try:
            await asyncio.wait_for(self._listed.wait(), seconds)
        except TimeoutError:
            log.warning("pod_list_slow", waited_seconds=seconds)
            return False
        if self.ledger.awaiting_list:
            return False  # the list failed (logged by the feed); it is retried
        log.info("pods_listed", gpu_pods=self.ledger.live_pods)
        return True

    def _attempted(self) -> None:
        """A list failed: the extender waiting for its first list serves now (the
        filter keeps waiting for a list; the feed retries with a growing delay)."""
        if self._listed is not None:
            self._listed.set()

    def _cycle(self) -> None:
        if not self._resume:
            try:
                listed, self._resume = self.list_pods()
            except Exception:
                self._call(self._attempted)
                raise
            self._call(self._adopt, listed)
            log.info("pods_listed", pods=len(listed), encoding=self.encoding)
        self._watch_once()

    def _watched(self, kind: str, obj: dict[str, Any]) -> None:
        facts = facts_of(obj, self.prefix)
        if facts.uid:
            self._call(self._event, kind, facts)
