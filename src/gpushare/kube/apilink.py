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
  (``<prefix>/gpu.<container>: <uuid>``), for people and for ``kubectl gpushare inspect``
  (:class:`~gpushare.kube.podannotations.PodAnnotator`);
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
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from gpushare.gpu.health import HealthBoard
from gpushare.kube import nodestate, stateobject
from gpushare.kube.labels import LabelFacts, node_labels
from gpushare.kube.optin import node_opted_out
from gpushare.kube.podannotations import API_TIMEOUT, PodAnnotator, short_error
from gpushare.kube.podspecs import PodSpecBook, only_uid_of
from gpushare.kube.podwatch import PodWatch
from gpushare.kube.statepublish import StatePublisher
from gpushare.kube.stdlibclient import ApiClient, KubeConfigError, load_endpoint
from gpushare.share.devices import Inventory, Resource
from gpushare.share.records import Snapshot
from gpushare.share.restartholders import RestartHolders
from gpushare.share.usage import UsageLedger

log = structlog.get_logger(__name__)

DEBOUNCE_SECONDS = 1.0
#: After the first change, wait this long for more (a burst of Allocates) to join it.
PUBLISH_SETTLE_SECONDS = 0.2
#: ...and never write the state more often than this (seconds between writes).
MIN_PUBLISH_INTERVAL = 0.5
#: How often what was published is read back (and rewritten only where it differs).
RESYNC_SECONDS = 60.0
MAX_BACKOFF = 60.0


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


class ApiLink:
    """The API link's thread: the node's published state, the pod annotations, the pod
    watch. ``label_facts``: what the node labels say (default: the shared cards only);
    ``card_extras``: who holds what whole, the cards' own health and the cards not
    shared (:class:`gpushare.node.cardfacts.CardFacts`; None: shared cards only);
    ``restart``: who held units before a kubelet restart and is not listed since
    (published as ``kubeletRestarted`` while any is; None: never said);
    ``opt_in_label``: ``key=value``, the label the DaemonSet selects its nodes by ("": not
    said)."""

    #: At stop, whether the node has lost its opt-in label (``kubectl gpushare
    #: uninstall``, kube/optin.py); False whenever it cannot be known.
    opted_out: bool = False

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
        *,
        label_facts: LabelFacts | None = None,
        card_extras: Callable[[], nodestate.CardExtras] | None = None,
        restart: RestartHolders | None = None,
        opt_in_label: str = "",
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
        self.annotator = PodAnnotator(prefix, book)
        self._forget_health: Any = None
        #: Also given this node's pods after every list and watch event (the use-gputype
        #: choices, gputype.py).
        self.pod_listeners: list[Callable[[list[dict[str, Any]]], None]] = []
        self.pods = self._watch_pods(node_name, book)
        self.label_facts = label_facts or LabelFacts(
            gpus=[card.gpu for card in inventory.cards.values()]
        )
        self.card_extras = card_extras
        self.restart = restart
        self.opt_in_label = opt_in_label

    def _watch_pods(self, node_name: str, book: PodSpecBook) -> PodWatch:
        """This node's pods, watched (not started): the spec book reads them again through
        it when it misses a pod, and each list and watch event reaches the link."""
        pods = PodWatch(lambda: self._api, node_name, book)
        book.on_miss = pods.refresh_now
        pods.on_pods = self._pods_changed
        return pods

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
        self.annotator.shared(resource, uuid, first_id)
        self._wake.set()

    def notify_exclusive_allocated(self, resource: str, device_ids: list[str]) -> None:
        """Called after every Allocate of whole cards or MIG devices: annotate the pod
        like a shared allocation (the value lists the devices), publish the new state."""
        self.annotator.exclusive(resource, device_ids)
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
                error = str(exc) if isinstance(exc, ApiConfigMissing) else short_error(exc)
                log.warning("api_error", error=error, retry_seconds=backoff)
                if self._stop.wait(backoff):
                    break
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            wait = max(0.0, self.resync_seconds - (time.monotonic() - last_resync))
            if self.annotator:
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
        if not self.annotator:
            return
        assert self._api is not None
        self.annotator.annotate(self._api, self.read_records(), self._wake.set)

    def _pods_changed(self, pods: list[dict[str, Any]]) -> None:
        for listener in self.pod_listeners:
            listener(pods)

    def refresh_pods_now(self) -> bool:
        """Re-read this node's pods now (bounded and rate-limited); True if it did."""
        return self.pods.refresh_now()
