"""The daemon's conversation with the API server, kept off the kubelet's path.

With ``NODE_NAME`` set, :class:`ApiLink` runs one background thread that

* publishes the per-card state (JSON, see ``nodestate.py``: counts, and the pods they
  include) in the node's state object (ConfigMap ``gpushare-node-<node>``,
  ``stateobject.py``) and/or the Node annotation ``<prefix>/gpus``, as ``--node-state``
  says, and the labels ``<prefix>/gpu.product|count|memory`` on the Node (through
  :class:`~gpushare.kube.statepublish.StatePublisher`), :data:`PUBLISH_SETTLE_SECONDS`
  after a change (an Allocate, a fresh read of the kubelet's records that shows units
  released), at most once per :data:`MIN_PUBLISH_INTERVAL`; a state that did not change
  is never written again: every :data:`RESYNC_SECONDS` what was written is read back and
  only what differs is written;
* annotates each admitted pod with the card each of its containers got
  (``<prefix>/gpu.<container>: <uuid>``), for people and for ``kubectl gpushare inspect``;
* starts the :class:`~gpushare.kube.podwatch.PodWatch` that keeps the
  :class:`~gpushare.kube.podspecs.PodSpecBook` of this node's pods (the placement hints)
  current, and re-reads it on demand when a request matches no known pod.

It talks to the API server through :mod:`gpushare.kube.stdlibclient` (HTTP/JSON, standard
library), never through the ``kubernetes`` package. API errors are logged and retried
with backoff. Nothing here ever blocks Allocate, except the bounded, rate-limited
on-demand pod list.
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

from gpushare.gpu.health import HealthBoard
from gpushare.kube import nodestate, stateobject
from gpushare.kube.labels import LabelFacts, node_labels
from gpushare.kube.optin import node_opted_out
from gpushare.kube.podspecs import PodSpecBook, only_uid_of
from gpushare.kube.podwatch import PodWatch
from gpushare.kube.statepublish import StatePublisher
from gpushare.kube.stdlibclient import ApiClient, ApiStatusError, KubeConfigError, load_endpoint
from gpushare.share.devices import Inventory, Resource
from gpushare.share.records import Snapshot
from gpushare.share.restartholders import RestartHolders
from gpushare.share.usage import Holder, UsageLedger

log = structlog.get_logger(__name__)

DEBOUNCE_SECONDS = 1.0
#: After the first change, wait this long for more (a burst of Allocates) to join it.
PUBLISH_SETTLE_SECONDS = 0.2
#: ...and never write the state more often than this (seconds between writes).
MIN_PUBLISH_INTERVAL = 0.5
#: How often what was published is read back (and rewritten only where it differs).
RESYNC_SECONDS = 60.0
MAX_BACKOFF = 60.0
API_TIMEOUT = 5.0
POD_ANNOTATION_TRIES = 10
#: How many (pod, container, card) annotations are remembered to skip their repeats.
ANNOTATED_MEMORY = 4096
#: Answers to a pod patch that another try will not change (pod gone, RBAC, invalid).
FINAL_POD_PATCH_STATUSES = frozenset({403, 404, 422})


class ApiConfigMissing(Exception):
    """Neither the in-cluster service account nor a kubeconfig can be loaded."""


def connect_api() -> ApiClient:
    """The daemon's API client: the in-cluster service account, else the kubeconfig."""
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and not os.environ.get(
        "KUBECONFIG"
    )
    path = os.environ.get("KUBECONFIG")  # read now: tests and operators may change it
    source = (
        "the in-cluster service account"
        if in_cluster
        else f"the kubeconfig {path or '~/.kube/config'}"
    )
    try:
        return ApiClient(load_endpoint())
    except KubeConfigError as exc:
        raise ApiConfigMissing(
            f"cannot load {source} for the API link (Node/Pod annotations): {str(exc)[:160]}; "
            "mount a service account token, set KUBECONFIG, or turn the link off with "
            "--node-name '' (NODE_NAME unset)"
        ) from None


@dataclass
class _PendingPodAnnotation:
    resource: Resource | None  # None: a whole card or MIG device of ``exclusive``
    uuid: str  # the annotation's value: the card, or the whole devices, comma-separated
    first_id: str
    tries: int = 0
    exclusive: str = ""  # the exclusive resource's full name


class ApiLink:
    def __init__(
        self,
        node_name: str,
        prefix: str,
        inventory: Inventory,
        usage: UsageLedger,
        health: HealthBoard,
        book: PodSpecBook,
        read_records: Callable[[], Snapshot | None],
        extra_labels: Mapping[str, str] | None = None,
        state_mode: str = "both",
        namespace: str = "",
    ) -> None:
        self.extra_labels = dict(extra_labels or {})  # fixed at start (MIG: mig.labels)
        self.node_name = node_name
        self.prefix = prefix
        self.inventory = inventory
        self.usage = usage
        self.health = health
        self.book = book
        self.read_records = read_records  # a fresh read of the kubelet's records
        self.generation = 0
        self.published = threading.Event()  # set after each successful publication
        self.publishes = 0  # states published, for tests and metrics
        self.publisher = StatePublisher(
            lambda: self._api,
            node_name,
            prefix,
            namespace or stateobject.own_namespace(os.environ),
            state_mode,
        )
        #: seconds between two read-backs of what was published (tests shorten it)
        self.resync_seconds = RESYNC_SECONDS
        self.resynced = threading.Event()  # set after each read-back
        self._last_cards: (
            tuple[tuple[nodestate.CardState, ...], tuple[nodestate.WholeCardState, ...], str]
            | None
        ) = None
        self._api: ApiClient | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: deque[_PendingPodAnnotation] = deque()
        #: (pod UID, container, card) annotated lately, oldest first: skip the same again.
        self._annotated: dict[tuple[str, str, str], None] = {}
        self.annotations_handled = 0  # Allocates whose annotation was written or skipped
        self._forget_health: Any = None
        self.pods = PodWatch(lambda: self._api, node_name, book)
        book.on_miss = self.pods.refresh_now
        #: What the node labels say (the daemon adds the cards of every mode, the driver).
        self.label_facts = LabelFacts(gpus=[card.gpu for card in inventory.cards.values()])
        #: Also given this node's pods after every list and watch event (the use-gputype
        #: choices, gputype.py).
        self.pod_listeners: list[Callable[[list[dict[str, Any]]], None]] = []
        self.pods.on_pods = self._pods_changed
        #: Who holds what whole, the cards' own health and the cards not shared
        #: (:class:`gpushare.node.cardfacts.CardFacts`); None: shared cards only.
        self.card_extras: Callable[[], nodestate.CardExtras] | None = None
        #: who held units before a kubelet restart and is not listed since (published as
        #: ``kubeletRestarted`` while any is); None: never said
        self.restart: RestartHolders | None = None
        #: ``key=value``, the label the DaemonSet selects its nodes by ("": not said). At
        #: stop, whether the node has lost it (``kubectl gpushare uninstall``) is read into
        #: :attr:`opted_out`; False whenever it cannot be known.
        self.opt_in_label = ""
        self.opted_out = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._forget_health = self.health.listen(self._wake.set)  # publish health changes
        self._thread = threading.Thread(target=self._run, name="api-link", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._forget_health is not None:
            self._forget_health()
        self.pods.stop()
        if self._thread is not None:
            self._thread.join(timeout=API_TIMEOUT + 1)
        self.opted_out = self._api is not None and node_opted_out(
            self._api, self.node_name, self.opt_in_label
        )
        if self._api is not None:
            self._api.close()

    def notify_allocated(self, resource: Resource, uuid: str, first_id: str) -> None:
        """Called after every Allocate: annotate the pod, publish the new use."""
        self._pending.append(_PendingPodAnnotation(resource, uuid, first_id))
        self._wake.set()

    def notify_exclusive_allocated(self, resource: str, device_ids: list[str]) -> None:
        """Called after every Allocate of whole cards or MIG devices: annotate the pod
        like a shared allocation (the value lists the devices), publish the new state."""
        if device_ids:
            item = _PendingPodAnnotation(None, ",".join(device_ids), device_ids[0])
            item.exclusive = resource
            self._pending.append(item)
        self._wake.set()

    def notify_changed(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        backoff = 1.0
        last_publish = float("-inf")
        last_resync = time.monotonic()
        connected = False
        while not self._stop.is_set():
            try:
                if self._api is None:
                    self._api = connect_api()
                    self.pods.start()
                if not connected:
                    self._read_generation()
                    connected = True
                    log.info("api_connected", node=self.node_name)
                if self._publish_node(force=False):
                    last_publish = time.monotonic()
                if time.monotonic() - last_resync >= self.resync_seconds:
                    self.publisher.resync(self.labels())
                    last_resync = time.monotonic()
                    self.resynced.set()
                self._annotate_pods()
                backoff = 1.0
            except Exception as exc:  # the API server is down, RBAC is missing, ...
                error = str(exc) if isinstance(exc, ApiConfigMissing) else _short(exc)
                log.warning("api_error", error=error, retry_seconds=backoff)
                if self._stop.wait(backoff):
                    break
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            wait = max(0.0, self.resync_seconds - (time.monotonic() - last_resync))
            if self._pending:
                wait = min(wait, DEBOUNCE_SECONDS)
            if self._wake.wait(wait) and not self._stop.is_set():
                # Let a burst of changes settle, and keep writes apart.
                since = time.monotonic() - last_publish
                self._stop.wait(max(PUBLISH_SETTLE_SECONDS, MIN_PUBLISH_INTERVAL - since))
            self._wake.clear()

    def _read_generation(self) -> None:
        """Continue from the highest generation published before (Node or object)."""
        self.generation = max(self.generation, self.publisher.connect())

    # ------------------------------------------------------------------ Node state
    def _pod_key(self, namespace: str, name: str) -> str:
        """The pod's UID when exactly one pod of that name is on record, else its name."""
        return only_uid_of(self.book, namespace, name) or f"{namespace}/{name}"

    def _counted(
        self, uuid: str, pods: Mapping[tuple[str, str], tuple[int, int]]
    ) -> tuple[tuple[tuple[str, int, int], ...], bool]:
        listed = sorted(
            ((self._pod_key(ns, name), *units) for (ns, name), units in pods.items()),
            key=lambda item: item[0],
        )
        limit = nodestate.MAX_PODS_PER_CARD
        return tuple(listed[:limit]), len(listed) > limit

    def node_state(self) -> nodestate.NodeGpuState:
        # The pods first: each one listed is in the counts read after it (a release in
        # between makes the counts smaller and drops the pod; see UsageLedger).
        counted = self.usage.counted_pods()
        memory_used = self.usage.used_counts(Resource.MEMORY)
        core_used = self.usage.used_counts(Resource.CORE)
        pods = {uuid: self._counted(uuid, counted.get(uuid, {})) for uuid in self.inventory.cards}
        extras = self.card_extras() if self.card_extras is not None else nodestate.CardExtras()
        hardware = extras.hardware_healthy or {}
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
                held_by=extras.held_by(card.uuid),
                hardware_healthy=hardware.get(card.uuid),
                pods=pods[card.uuid][0],
                pods_truncated=pods[card.uuid][1],
            )
            for card in self.inventory.cards.values()
        )
        return nodestate.NodeGpuState(
            generation=self.generation + 1,
            updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            memory_unit_mib=self.inventory.memory_unit_mib,
            cards=cards,
            whole=tuple(nodestate.listed_claims(card) for card in extras.whole),
            kubelet_restarted=self.restart.restarted_at() if self.restart is not None else "",
            enforcement=extras.enforcement,
        )

    def labels(self) -> dict[str, str]:
        return node_labels(self.prefix, self.label_facts) | self.extra_labels

    def _publish_node(self, force: bool = True) -> bool:
        """Publish the node's state; unless ``force``, only if it changed. True if written."""
        state = self.node_state()
        shown = (state.cards, state.whole, state.kubelet_restarted)
        if not force and shown == self._last_cards:
            self.published.set()  # what readers see is the current state already
            return False
        self.publisher.publish(nodestate.encode(state), self.labels())
        self.generation = state.generation
        self._last_cards = shown
        self.publishes += 1
        self.published.set()
        log.debug("node_published", node=self.node_name, generation=state.generation)
        return True

    # ------------------------------------------------------------------ Pod annotations
    def _annotate_pods(self) -> None:
        if not self._pending:
            return
        snapshot = self.read_records()
        retry: list[_PendingPodAnnotation] = []
        batch_only: list[tuple[str, str, str]] = []
        while self._pending:
            item = self._pending.popleft()
            holder = _holder(snapshot, item)
            if holder is None:
                item.tries += 1
                if item.tries < POD_ANNOTATION_TRIES:
                    retry.append(item)
                else:
                    self.annotations_handled += 1
                continue
            # A container's two resources name the same card: annotate it once. The pod's
            # UID keeps a pod re-created under the same name from being skipped.
            uid = self.book.uid_of(holder.namespace, holder.pod)
            done_key = (uid or f"{holder.namespace}/{holder.pod}", holder.container, item.uuid)
            if done_key in self._annotated:
                self.annotations_handled += 1
                continue
            key = nodestate.pod_annotation_key(self.prefix, holder.container)
            body = {"metadata": {"annotations": {key: item.uuid}}}
            path = f"/api/v1/namespaces/{holder.namespace}/pods/{holder.pod}"
            try:
                assert self._api is not None
                self._api.merge_patch(path, body, timeout=API_TIMEOUT)
            except Exception as exc:
                if isinstance(exc, ApiStatusError) and exc.status in FINAL_POD_PATCH_STATUSES:
                    # Gone, forbidden or refused: no retry will change that; move on.
                    log.warning(
                        "pod_annotation_dropped",
                        pod=holder.pod,
                        namespace=holder.namespace,
                        error=_short(exc),
                    )
                    self.annotations_handled += 1
                    continue
                # The API server is down or busy: keep it (and the rest) for later.
                self._pending.extendleft(reversed([item, *retry]))
                for done in batch_only:
                    self._annotated.pop(done, None)
                raise
            log.info(
                "pod_annotated",
                pod=holder.pod,
                namespace=holder.namespace,
                container=holder.container,
                gpu=item.uuid,
            )
            self.annotations_handled += 1
            if item.resource is None:
                self._wake.set()  # publish again: the records now name the holder
            self._annotated[done_key] = None
            while len(self._annotated) > ANNOTATED_MEMORY:
                self._annotated.pop(next(iter(self._annotated)))
            if uid is None:  # without a UID only this batch may skip the other resource
                batch_only.append(done_key)
        for done in batch_only:
            self._annotated.pop(done, None)
        self._pending.extend(retry)

    def _pods_changed(self, pods: list[dict[str, Any]]) -> None:
        for listener in self.pod_listeners:
            listener(pods)

    def refresh_pods_now(self) -> bool:
        """Re-read this node's pods now (bounded and rate-limited); True if it did."""
        return self.pods.refresh_now()


def _holder(snapshot: Snapshot | None, item: _PendingPodAnnotation) -> Holder | None:
    if snapshot is None:
        return None
    if item.resource is None:
        return snapshot.exclusive.get(item.exclusive, {}).get(item.first_id)
    return snapshot.holder_of(item.resource, item.first_id)


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
