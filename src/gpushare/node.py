"""The daemon's conversation with the API server, kept off the kubelet's path.

With ``NODE_NAME`` set, :class:`ApiLink` runs one background thread that

* publishes the per-card state on the Node: annotation ``<prefix>/gpus`` (JSON, see
  ``nodestate.py``) and labels ``<prefix>/gpu.product|count|memory``, debounced after
  every change and at least every :data:`REFRESH_SECONDS`;
* annotates each admitted pod with the card each of its containers got
  (``<prefix>/gpu.<container>: <uuid>``), for people and for ``kubectl gpushare inspect``;
* keeps the :class:`~gpushare.podspecs.PodSpecBook` of this node's pods, the placement
  hints, and re-reads it on demand when a request matches no known pod.

API errors are logged and retried with backoff. Nothing here ever blocks Allocate,
except the bounded, rate-limited on-demand pod list.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from gpushare import nodestate
from gpushare.devices import Inventory, Resource
from gpushare.health import HealthBoard
from gpushare.labels import LabelFacts, node_labels
from gpushare.podresources import PodResourcesClient
from gpushare.podspecs import PodSpecBook
from gpushare.usage import UsageLedger

log = structlog.get_logger(__name__)

DEBOUNCE_SECONDS = 1.0
REFRESH_SECONDS = 30.0
RELIST_SECONDS = 15.0
MAX_BACKOFF = 60.0
API_TIMEOUT = 5.0
ON_DEMAND_TIMEOUT = 1.0
ON_DEMAND_MIN_INTERVAL = 0.2
POD_ANNOTATION_TRIES = 10
#: Answers to a pod patch that another try will not change (pod gone, RBAC, invalid).
FINAL_POD_PATCH_STATUSES = frozenset({403, 404, 422})


class ApiConfigMissing(Exception):
    """Neither the in-cluster service account nor a kubeconfig can be loaded."""


def connect_api() -> Any:
    """A CoreV1Api from the in-cluster config, else the current kubeconfig (slow import)."""
    from kubernetes import client, config

    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    path = os.environ.get("KUBECONFIG")  # read now, not when the client was first imported
    source = (
        "the in-cluster service account"
        if in_cluster
        else f"the kubeconfig {path or '~/.kube/config'}"
    )
    try:
        if in_cluster:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(config_file=path)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise ApiConfigMissing(
            f"cannot load {source} for the API link (Node/Pod annotations): {_short(exc)[:160]}; "
            "mount a service account token, set KUBECONFIG, or turn the link off with "
            "--node-name '' (NODE_NAME unset)"
        ) from None
    return client.CoreV1Api()


@dataclass
class _PendingPodAnnotation:
    resource: Resource
    uuid: str
    first_id: str
    tries: int = 0


class ApiLink:
    def __init__(
        self,
        node_name: str,
        prefix: str,
        inventory: Inventory,
        usage: UsageLedger,
        health: HealthBoard,
        book: PodSpecBook,
        records: PodResourcesClient,
        extra_labels: Mapping[str, str] | None = None,
    ) -> None:
        self.extra_labels = dict(extra_labels or {})  # fixed at start (MIG: mig.labels)
        self.node_name = node_name
        self.prefix = prefix
        self.inventory = inventory
        self.usage = usage
        self.health = health
        self.book = book
        self.records = records
        self.generation = 0
        self.published = threading.Event()  # set after each successful Node update
        self._api: Any = None
        self._api_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: deque[_PendingPodAnnotation] = deque()
        self._last_on_demand = 0.0
        #: What the node labels say (the daemon adds the cards of every mode, the driver).
        self.label_facts = LabelFacts(gpus=[card.gpu for card in inventory.cards.values()])
        #: Also given every pod list read (the use-gputype choices, gputype.py).
        self.pod_listeners: list[Callable[[list[dict[str, Any]]], None]] = []
        book.on_miss = self.refresh_pods_now

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="api-link", daemon=True)
        self._thread.start()
        threading.Thread(target=self._follow_health, name="api-link-health", daemon=True).start()

    def _follow_health(self) -> None:
        seen = self.health.version
        while not self._stop.is_set():
            version = self.health.wait_for_change(seen, timeout=5.0, give_up=self._stop.is_set)
            if version != seen:
                seen = version
                self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.health.wake()
        if self._thread is not None:
            self._thread.join(timeout=API_TIMEOUT + 1)

    def notify_allocated(self, resource: Resource, uuid: str, first_id: str) -> None:
        """Called after every Allocate: annotate the pod, publish the new use."""
        self._pending.append(_PendingPodAnnotation(resource, uuid, first_id))
        self._wake.set()

    def notify_changed(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        backoff = 1.0
        last_publish = last_relist = float("-inf")
        while not self._stop.is_set():
            try:
                if self._api is None:
                    api = connect_api()
                    with self._api_lock:
                        self._api = api
                    self._read_generation()
                    log.info("api_connected", node=self.node_name)
                now = time.monotonic()
                if now - last_relist >= RELIST_SECONDS:
                    self._relist_pods(API_TIMEOUT)
                    last_relist = now
                self._publish_node()
                last_publish = time.monotonic()
                self._annotate_pods()
                backoff = 1.0
            except Exception as exc:  # the API server is down, RBAC is missing, ...
                error = str(exc) if isinstance(exc, ApiConfigMissing) else _short(exc)
                log.warning("api_error", error=error, retry_seconds=backoff)
                if self._stop.wait(backoff):
                    break
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            wait = max(
                0.0,
                min(
                    REFRESH_SECONDS - (time.monotonic() - last_publish),
                    RELIST_SECONDS - (time.monotonic() - last_relist),
                ),
            )
            if self._pending:
                wait = min(wait, DEBOUNCE_SECONDS)
            if self._wake.wait(wait) and not self._stop.is_set():
                self._stop.wait(DEBOUNCE_SECONDS)  # let a burst of changes settle
            self._wake.clear()

    def _read_generation(self) -> None:
        node = self._api.read_node(self.node_name, _request_timeout=API_TIMEOUT)
        annotations = (node.metadata.annotations or {}) if node.metadata else {}
        text = annotations.get(nodestate.annotation_key(self.prefix))
        if text:
            try:
                self.generation = nodestate.decode(text).generation
            except ValueError:
                self.generation = 0

    # ------------------------------------------------------------------ Node state
    def node_state(self) -> nodestate.NodeGpuState:
        memory_used = self.usage.used_counts(Resource.MEMORY)
        core_used = self.usage.used_counts(Resource.CORE)
        cards = tuple(
            nodestate.CardState(
                uuid=card.uuid,
                index=card.gpu.index,
                name=card.gpu.name,
                memory_mib=card.gpu.memory_mib,
                memory_units=card.memory_units,
                memory_units_used=memory_used.get(card.uuid, 0),
                core_units=card.units(Resource.CORE),
                core_units_used=core_used.get(card.uuid, 0),
                healthy=self.health.is_healthy(card.uuid),
            )
            for card in self.inventory.cards.values()
        )
        return nodestate.NodeGpuState(
            generation=self.generation + 1,
            updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            memory_unit_mib=self.inventory.memory_unit_mib,
            cards=cards,
        )

    def labels(self) -> dict[str, str]:
        return node_labels(self.prefix, self.label_facts) | self.extra_labels

    def _publish_node(self) -> None:
        state = self.node_state()
        body = {
            "metadata": {
                "labels": self.labels(),
                "annotations": {nodestate.annotation_key(self.prefix): nodestate.encode(state)},
            }
        }
        self._api.patch_node(self.node_name, body, _request_timeout=API_TIMEOUT)
        self.generation = state.generation
        self.published.set()
        log.debug("node_published", node=self.node_name, generation=state.generation)

    # ------------------------------------------------------------------ Pod annotations
    def _annotate_pods(self) -> None:
        if not self._pending:
            return
        snapshot = self.records.list()
        retry: list[_PendingPodAnnotation] = []
        while self._pending:
            item = self._pending.popleft()
            holder = snapshot.holder_of(item.resource, item.first_id) if snapshot else None
            if holder is None:
                item.tries += 1
                if item.tries < POD_ANNOTATION_TRIES:
                    retry.append(item)
                continue
            key = nodestate.pod_annotation_key(self.prefix, holder.container)
            body = {"metadata": {"annotations": {key: item.uuid}}}
            try:
                self._api.patch_namespaced_pod(
                    holder.pod, holder.namespace, body, _request_timeout=API_TIMEOUT
                )
            except Exception as exc:
                if getattr(exc, "status", None) in FINAL_POD_PATCH_STATUSES:
                    # Gone, forbidden or refused: no retry will change that; move on.
                    log.warning(
                        "pod_annotation_dropped",
                        pod=holder.pod,
                        namespace=holder.namespace,
                        error=_short(exc),
                    )
                    continue
                # The API server is down or busy: keep it (and the rest) for later.
                self._pending.extendleft(reversed([item, *retry]))
                raise
            log.info(
                "pod_annotated",
                pod=holder.pod,
                namespace=holder.namespace,
                container=holder.container,
                gpu=item.uuid,
            )
        self._pending.extend(retry)

    # ------------------------------------------------------------------ pod specs
    def _relist_pods(self, timeout: float) -> None:
        with self._api_lock:
            api = self._api
        if api is None:
            return
        pods = api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node_name}", _request_timeout=timeout
        )
        serialize = api.api_client.sanitize_for_serialization
        items = [serialize(pod) for pod in pods.items]
        self.book.replace_all(items)
        for listener in self.pod_listeners:
            listener(items)

    def refresh_pods_now(self) -> bool:
        """Re-read this node's pods now (bounded and rate-limited); True if it did."""
        now = time.monotonic()
        if self._api is None or now - self._last_on_demand < ON_DEMAND_MIN_INTERVAL:
            return False
        self._last_on_demand = now
        try:
            self._relist_pods(ON_DEMAND_TIMEOUT)
        except Exception as exc:
            log.warning("pod_list_failed", error=_short(exc))
            return False
        return True


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
