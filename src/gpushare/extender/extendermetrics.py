"""The extender's Prometheus metrics, in a registry of their own (served at /metrics)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ExtenderMetrics:
    def __init__(
        self,
        holds: Callable[[], int],
        remembered_pods: Callable[[], int],
        watched_pods: Callable[[], int] = lambda: 0,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "gpushare_extender_requests",
            "Requests served, by verb and HTTP status",
            ["verb", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "gpushare_extender_request_seconds",
            "Time to answer a request, by verb",
            ["verb"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.verdicts = Counter(
            "gpushare_extender_node_verdicts",
            "Filter verdicts per node, by reason (fits, no_room, held, no_gpus, "
            "no_annotation, bad_annotation, card_choice, not_ready)",
            ["reason"],
            registry=self.registry,
        )
        self.bindings = Counter(
            "gpushare_extender_bindings",
            "Bind verb outcomes (bound, refused: no longer fits, failed: the API server "
            "did not bind)",
            ["result"],
            registry=self.registry,
        )
        ledger = Gauge(
            "gpushare_extender_ledger_holds",
            "Pods bound whose use the node annotation does not show yet",
            registry=self.registry,
        )
        ledger.set_function(lambda: float(holds()))
        pending = Gauge(
            "gpushare_extender_pods_awaiting_binding",
            "Pods filtered and not bound yet that the extender remembers",
            registry=self.registry,
        )
        pending.set_function(lambda: float(remembered_pods()))
        watched = Gauge(
            "gpushare_extender_watched_pods",
            "Live pods bound to a node and asking gpushare resources, from the pod watch",
            registry=self.registry,
        )
        watched.set_function(lambda: float(watched_pods()))
