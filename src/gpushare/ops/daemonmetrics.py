"""The node daemon's Prometheus metrics and liveness endpoint, on their own HTTP server.

``/metrics`` serves one registry per daemon (tests run several daemons in one
process). Per-card figures are read at scrape time from the usage ledger and the
health board, so they are never stale and cost nothing between scrapes; request
counts and latencies come from the servicers' ``observe`` hook.

``/healthz`` is for the liveness probe, whose only remedy is a restart, so it fails
only when a restart would help (see :func:`liveness`): a kubelet restart, during
which the plugin is briefly unregistered, never makes it fail.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gpushare.base.buildinfo import build_info
from gpushare.base.connguard import ConnectionGuard, ConnectionLimits, GuardedHTTPServer
from gpushare.gpu.health import HealthBoard
from gpushare.kube.nodestate import DRA_MODE, TIMESLICE_MODE, CardExtras
from gpushare.share.devices import Inventory, Resource
from gpushare.share.usage import UsageLedger

log = structlog.get_logger(__name__)

# No ``*_created`` series beside every counter and histogram: a timestamp per series that
# no dashboard or alert uses (process-wide; this process serves only gpushare's metrics).
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Latency buckets in seconds: the kubelet's calls should take a few milliseconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)

#: While the kubelet is up, this long unregistered means the link is stuck: restart.
UNREGISTERED_GRACE_SECONDS = 60.0


@dataclass(frozen=True)
class LinkState:
    """What liveness is decided from, as plain data."""

    serving: bool  # both gRPC servers run and the kubelet link thread is alive
    registered: bool
    unregistered_seconds: float  # since the last registration was lost (or since start)
    kubelet_present: bool  # kubelet.sock exists


def liveness(
    state: LinkState, grace_seconds: float = UNREGISTERED_GRACE_SECONDS
) -> tuple[bool, str]:
    """(alive, why). Alive while serving and registered, and also while registering
    again after a kubelet restart or waiting for a kubelet that is down (a restart
    of the plugin would not help there). Not alive when the servers or the link are
    gone, or when the kubelet is up but registration keeps failing."""
    if not state.serving:
        return False, "the device-plugin servers or the kubelet link are not running"
    if state.registered:
        return True, "serving and registered"
    if not state.kubelet_present:
        return True, "serving; waiting for the kubelet socket to come back"
    if state.unregistered_seconds <= grace_seconds:
        return True, f"serving; registering (unregistered for {state.unregistered_seconds:.1f} s)"
    return False, (
        f"the kubelet is up but registration has failed for {state.unregistered_seconds:.0f} s"
    )


#: Labels of every per-card series: the UUID, NVML's index, the model and the node.
CARD_LABELS = ["gpu", "index", "model", "node"]
#: Labels of every per-container series.
CONTAINER_LABELS = ["namespace", "pod", "container", "gpu", "node"]
#: Labels of a container's whole card or MIG device (``device`` = its UUID).
DEVICE_LABELS = ["namespace", "pod", "container", "gpu", "device", "resource", "node"]
#: Labels of one device of a DRA claim (``device`` = the published device's name).
CLAIM_LABELS = ["namespace", "claim", "request", "device", "gpu", "node"]
MIB = 1 << 20


#: Series renamed in 0.2 (Prometheus' conventions: a gauge does not end in ``_total``, the
#: unit is the suffix), new name -> old name. The old names are served too, as deprecated
#: duplicates, for one release: dashboards and alerts have that long to move.
RENAMED = {
    "gpushare_memory_units_capacity": "gpushare_memory_units_total",
    "gpushare_memory_capacity_bytes": "gpushare_memory_bytes_total",
    "gpushare_memory_allocated_bytes": "gpushare_memory_bytes_allocated",
    "gpushare_core_units_capacity": "gpushare_core_units_total",
    "gpushare_dra_memory_capacity_bytes": "gpushare_dra_memory_bytes_total",
    "gpushare_dra_memory_allocated_bytes": "gpushare_dra_memory_bytes_allocated",
}


def with_deprecated(families: Iterable[Metric]) -> Iterator[Metric]:
    """``families``, each renamed one followed by a copy under its old name whose HELP
    says it is deprecated and names the new one."""
    for family in families:
        yield family
        old = RENAMED.get(family.name)
        if old is None:
            continue
        copy = GaugeMetricFamily(
            old, f"DEPRECATED: use {family.name} (this name goes in the next release). "
            f"{family.documentation}"
        )
        copy.samples = [sample._replace(name=old) for sample in family.samples]
        yield copy


class _CardCollector:
    """Per-card and per-container gauges, read from the ledger and the board at scrape
    time, plus whatever ``extra`` adds."""

    def __init__(
        self,
        inventory: Inventory,
        usage: UsageLedger,
        health: HealthBoard,
        extra: Callable[[], list[Metric]],
        node: str = "",
        card_extras: Callable[[], CardExtras | None] = lambda: None,
    ) -> None:
        self._card_extras = card_extras
        self._inventory = inventory
        self._usage = usage
        self._health = health
        self._extra = extra
        self._node = node

    def collect(self) -> Iterator[Metric]:
        def card_gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=CARD_LABELS)

        families = {
            "memory_total": card_gauge(
                "gpushare_memory_units_capacity", "Memory units advertised per GPU"
            ),
            "memory_used": card_gauge(
                "gpushare_memory_units_allocated",
                "Memory units allocated per GPU (the kubelet's records and recent Allocates)",
            ),
            "bytes_total": card_gauge(
                "gpushare_memory_capacity_bytes",
                "GPU memory advertised per GPU in bytes (memory units times the unit size)",
            ),
            "bytes_used": card_gauge(
                "gpushare_memory_allocated_bytes", "GPU memory allocated per GPU in bytes"
            ),
            "core_total": card_gauge(
                "gpushare_core_units_capacity", "Core units advertised per GPU"
            ),
            "core_used": card_gauge(
                "gpushare_core_units_allocated",
                "Core units allocated per GPU (the kubelet's records and recent Allocates)",
            ),
            "healthy": card_gauge(
                "gpushare_gpu_healthy",
                "1 if the GPU itself is healthy (a card held whole is healthy; every card of "
                "the node, shared or not, as kubectl gpushare inspect shows it)",
            ),
        }
        unit_bytes = self._inventory.memory_unit_mib * MIB
        memory_used = self._usage.used_counts(Resource.MEMORY)
        core_used = self._usage.used_counts(Resource.CORE)
        for uuid, card in self._inventory.cards.items():
            labels = [uuid, str(card.gpu.index), card.gpu.name, self._node]
            used = memory_used.get(uuid, 0)
            families["memory_total"].add_metric(labels, card.units(Resource.MEMORY))
            families["memory_used"].add_metric(labels, used)
            families["bytes_total"].add_metric(labels, card.units(Resource.MEMORY) * unit_bytes)
            families["bytes_used"].add_metric(labels, used * unit_bytes)
            families["core_total"].add_metric(labels, card.units(Resource.CORE))
            families["core_used"].add_metric(labels, core_used.get(uuid, 0))
            families["healthy"].add_metric(labels, 1 if self._health.is_healthy(uuid) else 0)
        extras = self._card_extras()
        for whole in extras.whole if extras is not None else ():
            labels = [whole.uuid, str(whole.index), whole.name, self._node]
            families["healthy"].add_metric(labels, 1 if whole.healthy else 0)
        yield from with_deprecated(families.values())
        yield from self._containers(unit_bytes)
        if extras is not None:
            yield from self._whole(extras)
            yield from self._dra(extras)
            yield self._enforcement(extras)
        yield from self._extra()

    def _enforcement(self, extras: CardExtras) -> Metric:
        """Which backend holds each card's memory and compute limits (decided at start)."""
        family = GaugeMetricFamily(
            "gpushare_enforcement_backend",
            "1 for the backend that holds each GPU's limits: kind memory (driver, "
            "interposer, hardware, none) or compute (mps, interposer, hardware, none)",
            labels=["gpu", "index", "node", "kind", "backend"],
        )
        for card in extras.enforcement:
            for kind, backend in (("memory", card.memory), ("compute", card.compute)):
                family.add_metric([card.uuid, str(card.index), self._node, kind, backend], 1)
        return family

    def _dra(self, extras: CardExtras) -> Iterator[Metric]:
        """The cards served by the DRA driver: what its prepared claims hold."""

        def card_gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=CARD_LABELS)

        claims = card_gauge("gpushare_dra_claims", "ResourceClaim devices prepared per DRA card")
        total = card_gauge(
            "gpushare_dra_memory_capacity_bytes",
            "GPU memory a DRA card publishes in bytes (rounded down to the memory unit; a "
            "card in MIG mode: its MIG devices' memory together)",
        )
        memory = card_gauge(
            "gpushare_dra_memory_allocated_bytes",
            "GPU memory of the claims prepared per DRA card in bytes (the limits enforced)",
        )
        cores = card_gauge(
            "gpushare_dra_cores_allocated",
            "Cores (percent of the SMs) of the claims prepared per DRA card (0: unthrottled)",
        )
        claim_memory = GaugeMetricFamily(
            "gpushare_dra_claim_memory_bytes",
            "GPU memory limit of each device of a prepared ResourceClaim, in bytes",
            labels=CLAIM_LABELS,
        )
        claim_cores = GaugeMetricFamily(
            "gpushare_dra_claim_cores",
            "Cores (percent of the SMs) of each device of a prepared ResourceClaim that has "
            "a core limit",
            labels=CLAIM_LABELS,
        )
        unit = self._inventory.memory_unit_mib
        for card in extras.whole:
            if card.mode != DRA_MODE:
                continue
            labels = [card.uuid, str(card.index), card.name, self._node]
            claims.add_metric(labels, card.claim_count)
            total.add_metric(labels, card.dra_memory_total(unit) * MIB)
            memory.add_metric(labels, card.memory_used_mib * MIB)
            cores.add_metric(labels, card.cores_used)
            for claim in card.claims:
                named = [claim.namespace, claim.claim, claim.request, claim.device, card.uuid]
                if claim.memory_mib is not None:
                    claim_memory.add_metric([*named, self._node], claim.memory_mib * MIB)
                if claim.cores:
                    claim_cores.add_metric([*named, self._node], claim.cores)
        yield from with_deprecated((claims, total, memory, cores, claim_memory, claim_cores))

    def _whole(self, extras: CardExtras) -> Iterator[Metric]:
        devices = GaugeMetricFamily(
            "gpushare_container_devices",
            "Whole cards and MIG devices each container holds (1 per device; gpu is the "
            "card, device the card or MIG device; the kubelet's PodResources records)",
            labels=DEVICE_LABELS,
        )
        for hold in extras.holds:
            devices.add_metric(
                [hold.namespace, hold.pod, hold.container, hold.card, hold.device,
                 hold.resource, self._node],
                1,
            )  # fmt: skip
        mig = GaugeMetricFamily(
            "gpushare_mig_device_healthy",
            "1 if the MIG device (served whole) is healthy",
            labels=["gpu", "device", "profile", "node"],
        )
        for card in extras.whole:
            for device in card.mig:
                mig.add_metric(
                    [card.uuid, device.uuid, device.profile, self._node],
                    1 if device.healthy else 0,
                )
        replicas = GaugeMetricFamily(
            "gpushare_timeslice_replicas",
            "Time-sliced replicas a card in card mode timeslice offers (gpu.shared)",
            labels=["gpu", "index", "name", "node"],
        )
        held = GaugeMetricFamily(
            "gpushare_timeslice_replicas_held",
            "Time-sliced replicas of a card held by containers (the kubelet's records)",
            labels=["gpu", "index", "name", "node"],
        )
        for card in extras.whole:
            if card.mode == TIMESLICE_MODE:
                labels = [card.uuid, str(card.index), card.name, self._node]
                replicas.add_metric(labels, card.replicas)
                held.add_metric(labels, card.replicas_held)
        yield devices
        yield mig
        yield replicas
        yield held

    def _containers(self, unit_bytes: int) -> Iterator[Metric]:
        memory = GaugeMetricFamily(
            "gpushare_container_memory_bytes",
            "GPU memory limit of each container holding memory units, by card "
            "(the kubelet's PodResources records)",
            labels=CONTAINER_LABELS,
        )
        core = GaugeMetricFamily(
            "gpushare_container_core_units",
            "Core units (percent of the SMs) of each container holding core units, by card",
            labels=CONTAINER_LABELS,
        )
        for uuid, holders in sorted(self._usage.holders().items()):
            if uuid not in self._inventory.cards:
                continue  # a card that is gone: its records are not this node's figures
            for holder, units in holders.items():
                labels = [holder.namespace, holder.pod, holder.container, uuid, self._node]
                if units.get(Resource.MEMORY):
                    memory.add_metric(labels, units[Resource.MEMORY] * unit_bytes)
                if units.get(Resource.CORE):
                    core.add_metric(labels, units[Resource.CORE])
        yield memory
        yield core


#: The calls that hand something out, counted in ``gpushare_allocations``.
ALLOCATING = frozenset({"Allocate", "NodePrepareResources"})


class Metrics:
    """One daemon's metrics, in its own registry."""

    def __init__(
        self,
        inventory: Inventory,
        usage: UsageLedger,
        health: HealthBoard,
        resource_names: dict[Resource, str],
        pod_resources_reads: Callable[[], tuple[int, int]] | None = None,
        *,
        node: str = "",
        ready: Callable[[], bool] | None = None,
        registered: Callable[[], Mapping[str, bool]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._names = resource_names
        self._pod_resources_reads = pod_resources_reads
        self._ready = ready
        self._registered = registered
        self.allocations = Counter(
            "gpushare_allocations",
            "Allocate and NodePrepareResources calls answered, by resource (the DRA "
            "driver's name for a claim) and result (ok or the refusal)",
            ["resource", "result"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "gpushare_request_duration_seconds",
            "Time to answer a kubelet call (device plugin or DRA), by resource and method",
            ["resource", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        #: Holders of whole cards and MIG devices, unshared cards (set by the daemon).
        self.card_extras: Callable[[], CardExtras] | None = None
        self.registry.register(
            _CardCollector(
                inventory,
                usage,
                health,
                self._extra,
                node,
                lambda: self.card_extras() if self.card_extras is not None else None,
            )
        )

    def observe(self, resource: str, method: str, result: str, seconds: float) -> None:
        """The kubelet doors' hook (:data:`gpushare.base.kubeletgrpc.CallHook`), called
        after every call of every door: each is timed, and each call that hands
        something out (:data:`ALLOCATING`: Allocate, NodePrepareResources) counted."""
        self.latency.labels(resource, method).observe(seconds)
        if method in ALLOCATING:
            self.allocations.labels(resource, result).inc()

    def _extra(self) -> list[Metric]:
        ready = self._ready() if self._ready is not None else True
        found: list[Metric] = [_ready_family(1 if ready else 0), _build_info_family()]
        registered = GaugeMetricFamily(
            "gpushare_registered",
            "1 while the resource is registered with the kubelet",
            labels=["resource"],
        )
        states = self._registered() if self._registered is not None else {}
        for name in self._names.values():
            registered.add_metric([name], 1 if states.get(name) else 0)
        found.append(registered)
        if self._pod_resources_reads is None:
            return found
        ok, failed = self._pod_resources_reads()
        reads = CounterMetricFamily(
            "gpushare_pod_resources_reads",
            "Reads of the kubelet's PodResources list, by result",
            labels=["result"],
        )
        reads.add_metric(["ok"], ok)
        reads.add_metric(["failed"], failed)
        return [*found, reads]

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


def _ready_family(value: int) -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "gpushare_ready",
        "1 exactly when /readyz answers 200: the GPUs are served and every resource is "
        "registered with the kubelet",
        value=value,
    )


def _build_info_family() -> GaugeMetricFamily:
    info = build_info()
    family = GaugeMetricFamily(
        "gpushare_build_info", "Always 1; the labels name this build", labels=list(info)
    )
    family.add_metric(list(info.values()), 1)
    return family


class _NotReadyCollector:
    def collect(self) -> Iterator[Metric]:
        yield _ready_family(0)
        yield _build_info_family()


def render_not_ready() -> bytes:
    """What ``/metrics`` serves before the GPUs are known: ``gpushare_ready 0``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_NotReadyCollector())
    return bytes(generate_latest(registry))


#: Seconds a connection may stay silent before its thread closes it.
REQUEST_TIMEOUT = 10.0
#: The bounds of the metrics listener (base/connguard.py): 32 connections (and so
#: handler threads) at once, 8 from one address, 10 s for a whole request.
METRICS_LIMITS = ConnectionLimits(max_connections=32, max_per_peer=8, deadline=10.0)


#: Scrapes rendering at once (issue 32.10: a flood of scrapes must not cost Allocate).
RENDER_CONCURRENCY = 2


class MetricsServer:
    """``/metrics`` and ``/healthz`` on ``address:port``: one accepting thread, one
    thread per admitted connection, under :data:`METRICS_LIMITS` (issue 23 item 3)."""

    def __init__(
        self,
        render: Callable[[], bytes],
        check: Callable[[], tuple[bool, str]],
        address: str,
        port: int,
        ready: Callable[[], tuple[bool, str]] | None = None,
        request_timeout: float = REQUEST_TIMEOUT,
        limits: ConnectionLimits = METRICS_LIMITS,
    ) -> None:
        self.guard = ConnectionGuard(limits)
        self.render = render
        # At most this many scrapes render at once (each costs CPU and the interpreter
        # lock the admission path needs); the rest wait for a turn, costing nothing.
        self._rendering = threading.BoundedSemaphore(RENDER_CONCURRENCY)
        self.request_timeout = request_timeout
        self.check = check
        self.ready = ready or check
        self.address = address
        self.port = port
        self._httpd: GuardedHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._wake_read = self._wake_write = -1

    def start(self) -> None:
        """Listen; raises OSError when the address cannot be bound."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = self.request_timeout  # a client that sends nothing is let go

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                probe = server._probe(path)
                if path == "/metrics":
                    with server._rendering:
                        body = server.render()
                    self._send(200, CONTENT_TYPE_LATEST, body)
                elif probe is not None:
                    self._send(*probe)
                else:
                    self._send(404, "text/plain", b"not found: try /metrics, /healthz or /readyz\n")

            def _send(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # probes every few seconds would drown the log

        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        server_class = type("MetricsHTTPServer", (GuardedHTTPServer,), {"address_family": family})
        httpd = server_class((self.address, self.port), Handler, self.guard, self._probe)
        self._httpd = httpd
        self.port = httpd.server_address[1]
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(
            target=self._serve, args=(httpd, self._wake_read), name="metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics_serving", address=self.address, port=self.port)

    def _probe(self, path: str) -> tuple[int, str, bytes] | None:
        """The probes' answers, also given beyond the connection caps (connguard)."""
        if path in ("/healthz", "/livez"):
            alive, why = self.check()
            body = json.dumps({"alive": alive, "reason": why}).encode() + b"\n"
            return (200 if alive else 503), "application/json", body
        if path == "/readyz":
            ready, why = self.ready()
            body = json.dumps({"ready": ready, "reason": why}).encode() + b"\n"
            return (200 if ready else 503), "application/json", body
        return None

    @staticmethod
    def _serve(httpd: GuardedHTTPServer, wake: int) -> None:
        httpd.serve_until(wake)

    def stop(self) -> None:
        if self._thread is not None:
            os.write(self._wake_write, b"!")
            self._thread.join(timeout=5.0)
            self._thread = None
            for fd in (self._wake_read, self._wake_write):
                os.close(fd)
        if self._httpd is not None:
            self._httpd.server_close()
            self._httpd = None
