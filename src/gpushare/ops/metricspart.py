"""The daemon's metrics part: the HTTP server (started first, so that the probes are
answered while the GPUs are still being looked for) and, once the node's core is built,
the collectors that read it. Loaded only with ``--metrics-port`` set."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpushare.base.startup import StartupError
from gpushare.config import Settings
from gpushare.host.gc import CacheDirMetrics
from gpushare.host.mpsshm import MpsShmMetrics
from gpushare.node.core import NodeCore
from gpushare.ops.actualuse import ActualUseMetrics
from gpushare.ops.daemonmetrics import Metrics, MetricsServer, render_not_ready
from gpushare.share.devices import Resource

Probe = Callable[[], tuple[bool, str]]


class MetricsPart:
    """The ``metrics-server`` part; :meth:`read` attaches the core's collectors."""

    name = "metrics-server"

    def __init__(self, settings: Settings, liveness: Probe, readiness: Probe) -> None:
        self.settings = settings
        self.readiness = readiness
        self.metrics: Metrics | None = None
        self.server = MetricsServer(
            self.render, liveness, settings.metrics_address, settings.metrics_port, ready=readiness
        )

    def read(self, core: NodeCore, registered: Callable[[], dict[str, bool]]) -> Metrics:
        """Export ``core`` from now on; ``registered``: resource -> registered now."""
        prefix, refresher = self.settings.resource_prefix, core.refresher
        metrics = Metrics(
            core.inventory,
            core.usage,
            core.health,
            {resource: resource.name_with(prefix) for resource in Resource},
            pod_resources_reads=lambda: (refresher.reads, refresher.failures),
            node=self.settings.node_name,
            ready=lambda: self.readiness()[0],
            registered=registered,
        )
        metrics.registry.register(CacheDirMetrics(core.collector.sizes))
        if core.mps_shm is not None:
            metrics.registry.register(MpsShmMetrics(core.mps_shm))
        metrics.card_extras = core.card_facts.extras
        metrics.registry.register(  # what the containers really use (HAMi-core's own file)
            ActualUseMetrics(
                Path(self.settings.host_lib_dir),
                core.card_facts.records,
                core.usage,
                self.settings.node_name,
            )
        )
        self.metrics = metrics
        return metrics

    def render(self) -> bytes:
        return self.metrics.render() if self.metrics is not None else render_not_ready()

    def start(self) -> None:
        settings = self.settings
        try:
            self.server.start()
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {settings.metrics_address}:{settings.metrics_port}:"
                f" {exc.strerror or exc}; set --metrics-port (0 = off)"
            ) from None

    def stop(self) -> None:
        self.server.stop()

    def ready(self) -> tuple[bool, str]:
        return True, ""
