"""The node daemon's composition root: a list of parts built from the settings.

``gpushare-device-plugin`` runs :func:`main`. The parts, in start order: the metrics
server (first, so that probes are answered while the GPUs are still being looked for),
the node's shared core (:mod:`gpushare.node.core`: the kubelet's records, the reaper,
the health monitor), the front doors (the device plugin's servers and their kubelet
registration), then the API link and the usage refresher. They stop in reverse order.
Start-up order matters: the servers listen before anything registers, because the
kubelet dials back at once.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import structlog

from gpushare.base.buildinfo import build_info
from gpushare.base.logs import configure_logging
from gpushare.base.memory import limit_malloc_arenas
from gpushare.base.parts import Part, Parts
from gpushare.base.startup import StartupError
from gpushare.config import ConfigError, Settings, effective_config, load_settings_with_origins
from gpushare.deviceplugin.frontdoor import DevicePluginFrontDoor, check_kubelet_dir
from gpushare.gpu.gpus import GpuBackend
from gpushare.kube.podspecs import PodSpecBook
from gpushare.node.core import NodeCore, build_core, core_parts, late_parts
from gpushare.node.discovery import Discovery
from gpushare.node.enforcement import check_library
from gpushare.share.cardmodes import CardMode
from gpushare.share.devices import Resource

if TYPE_CHECKING:  # imported when used: the metrics server is optional
    from gpushare.ops.daemonmetrics import Metrics
    from gpushare.ops.metricspart import MetricsPart

log = structlog.get_logger(__name__)


class Daemon:
    """One node's daemon: the parts that serve its GPUs, started and stopped in order."""

    def __init__(
        self,
        settings: Settings,
        backend: GpuBackend | None = None,
        specs: PodSpecBook | None = None,
        kubelet_version: Callable[[], str] | None = None,
    ) -> None:
        self.settings = settings
        self.specs = specs
        #: the kubelet's version where no Node tells it (a simulated node's stand-in)
        self.kubelet_version = kubelet_version
        self.stopping = threading.Event()
        self.discovery = Discovery(settings, self.stopping, backend)
        self.running = Parts()
        self.core: NodeCore | None = None
        self.plugin: DevicePluginFrontDoor | None = None  # set once it serves
        self.metrics_part: MetricsPart | None = None
        self.metrics: Metrics | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts running, in start order (optional ones are absent when off)."""
        return self.running.names

    def start(self) -> None:
        """Serve and register. Returns once serving (registration goes on in the
        background); waits, with /healthz alive, while the GPUs cannot be read. Raises
        :class:`StartupError`, everything started so far stopped again, when the
        configuration cannot work or the daemon is stopped while waiting."""
        try:
            self._start()
        except StartupError:
            self._stop()  # quietly: the caller reports the one line that matters
            raise

    def _start(self) -> None:
        began = time.perf_counter()
        settings = self.settings
        if settings.metrics_port:
            from gpushare.ops.metricspart import MetricsPart  # prometheus_client, http.server

            self.metrics_part = MetricsPart(settings, self.liveness, self.readiness)
            self._launch(self.metrics_part)
        # What needs no GPU is checked before waiting for one: a wrong path or library is
        # reported (exit 2) while NVML is still missing, not once it works.
        if not settings.no_enforcement:
            check_library(Path(settings.library))
        check_kubelet_dir(Path(settings.kubelet_dir))
        self.core = core = build_core(settings, self.discovery.run(), self.specs)
        if self.metrics_part is not None:
            self.metrics = self.metrics_part.read(core, self._registered_resources)
        plugin = DevicePluginFrontDoor(
            core,
            self.stopping,
            observe=self.metrics.observe if self.metrics else None,
            kubelet_version=self.kubelet_version,
        )
        for part in core_parts(core):
            self._launch(part)
        self._launch(plugin)
        self.plugin = plugin
        if CardMode.DRA in core.modes.values():  # the second front door, beside the first
            from gpushare.dra.part import dra_part_for  # only where a card is in card mode dra

            dra = dra_part_for(core, self.metrics.observe if self.metrics else None)
            if dra is not None:
                self._launch(dra)
        for part in late_parts(core):
            self._launch(part)
        log.info(
            "daemon_started",
            parts=list(self.parts),
            start_ms=self.running.start_ms,
            total_ms=round((time.perf_counter() - began) * 1000, 1),
        )

    def _launch(self, part: Part) -> None:
        if self.stopping.is_set():
            raise StartupError("stopped while starting")
        self.running.launch(part)

    def liveness(self) -> tuple[bool, str]:
        """What /healthz answers (see :func:`gpushare.ops.daemonmetrics.liveness`)."""
        from gpushare.ops.daemonmetrics import LinkState, liveness

        plugin = self.plugin
        if plugin is None and not self.stopping.is_set():
            # Still starting: waiting for NVML or the GPUs, which a restart would not fix.
            waiting = self.discovery.waiting_for
            return True, f"starting; {waiting}" if waiting else "starting"
        link = plugin.link_health() if plugin is not None else None
        return liveness(
            LinkState(
                serving=link is not None and link.serving and not self.stopping.is_set(),
                registered=link is not None and link.registered,
                unregistered_seconds=link.unregistered_seconds if link is not None else 0.0,
                kubelet_present=self.settings.kubelet_socket.exists(),
            )
        )

    def readiness(self) -> tuple[bool, str]:
        """What /readyz answers: ready while every part is (the GPUs served and every
        resource registered). A rollout waits for this; liveness does not."""
        if self.stopping.is_set():
            return False, "stopping"
        if self.plugin is None:
            waiting = self.discovery.waiting_for
            return False, f"starting; {waiting}" if waiting else "starting"
        ready, why = self.running.ready()
        return (True, "serving and registered") if ready else (False, why)

    def _registered_resources(self) -> dict[str, bool]:
        plugin = self.plugin
        if plugin is not None:
            return plugin.registered_resources()
        return {resource.name_with(self.settings.resource_prefix): False for resource in Resource}

    def stop(self) -> None:
        self._stop()
        log.info("stopped")

    def _stop(self) -> None:
        """Stop every part started, in the reverse order, then close the GPUs."""
        self.stopping.set()
        if self.core is not None:
            boards = [self.core.health, self.core.availability, self.core.mig_health]
            boards += [board for _name, _devices, board in self.core.whole]
            for board in boards:  # whole cards' and replicas' streams wait on their own
                board.wake()  # waiters (streams included) see ``stopping`` at once
        self.running.stop_all()
        self.discovery.close()


def main(argv: Sequence[str] | None = None) -> int:
    limit_malloc_arenas()
    try:
        settings, origins = load_settings_with_origins(argv)
    except ConfigError as exc:
        print(f"gpushare-device-plugin: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    log.info("starting", **build_info(), config=effective_config(settings, origins))
    daemon = Daemon(settings)
    done = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal_received", signal=signal.Signals(signum).name)
        done.set()
        daemon.stopping.set()  # also ends a start that is still waiting for the GPUs

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    waker = SignalWaker()  # before start: a signal during start wakes the wait after it
    try:
        try:
            daemon.start()
        except StartupError as exc:
            if done.is_set():
                return 0  # told to stop while starting
            print(f"gpushare-device-plugin: {exc}", file=sys.stderr)
            return exc.exit_code
        # Everything built so far lives as long as the process: keep it out of the
        # collector's way, so that a full collection during an Allocate stays short.
        gc.collect()
        gc.freeze()
        waker.wait(done)
    finally:
        waker.close()
    daemon.stop()
    return 0


class SignalWaker:
    """Wakes the main thread for a signal whichever thread the kernel gave it to.

    Python runs a signal's handler in the main thread, between bytecodes; the kernel
    may deliver a process-directed SIGTERM to any thread that does not block it (gRPC's,
    the parts'), and the C-level handler that then runs there does not wake a main
    thread blocked in a lock (``Event.wait()`` without a timeout): the handler would
    never run and the drain be ignored. So the main thread sleeps in ``select`` on the
    signal wake-up descriptor, which that C-level handler writes in whichever thread it
    runs: the main thread wakes, returns to the interpreter, and the handler runs."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def wait(self, done: threading.Event) -> None:
        """Return once ``done`` is set (by a signal handler)."""
        while not done.is_set():
            select.select([self._read], [], [], 60.0)  # the timeout is only a safety net
            with contextlib.suppress(BlockingIOError):
                os.read(self._read, 512)

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        os.close(self._read)
        os.close(self._write)


if __name__ == "__main__":
    sys.exit(main())
