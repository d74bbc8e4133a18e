"""The node daemon: wires discovery, binding, the gRPC servers and the kubelet link.

``gpushare-device-plugin`` runs :func:`main`. Start-up order matters: the servers
listen before anything registers, because the kubelet dials back at once.
"""

from __future__ import annotations

import ctypes
import gc
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import structlog

from gpushare.answers import Enforcement
from gpushare.binding import Binder
from gpushare.config import ConfigError, Settings, load_settings
from gpushare.devices import Inventory, Resource
from gpushare.gc import GarbageCollector
from gpushare.gpus import Gpu, GpuBackend, GpuError, open_backend
from gpushare.health import HealthBoard, HealthMonitor, HealthPolicy
from gpushare.kubelet import KubeletLink
from gpushare.library import LibraryError, ensure_lock_dir, install_library, install_preload_file
from gpushare.logs import configure_logging
from gpushare.metrics import LinkState, Metrics, MetricsServer, liveness, render_not_ready
from gpushare.node import ApiLink
from gpushare.plugin import DevicePluginServicer, PluginServer, device_list_message
from gpushare.podresources import PodResourcesClient, Snapshot
from gpushare.podspecs import PodSpecBook
from gpushare.refresh import UsageRefresher
from gpushare.usage import UsageLedger

log = structlog.get_logger(__name__)

#: The kubelet refuses gRPC messages above 4 MiB; a device list must fit well inside.
KUBELET_MESSAGE_LIMIT = 4 << 20
#: ...so a device list may take three quarters of it at most.
MESSAGE_SIZE_ALLOWED = KUBELET_MESSAGE_LIMIT * 3 // 4
#: Delays between attempts to initialise NVML and list the GPUs at start: first, longest.
DISCOVERY_RETRY_SECONDS = (0.5, 30.0)


class StartupError(Exception):
    """The daemon cannot start; the message is the one line an operator reads."""

    #: The process exits with this: 2 for a configuration that cannot work, else 1.
    exit_code = 1


class ConfigurationTooLarge(StartupError):
    """The settings cannot work on this node's GPUs (e.g. too many device IDs)."""

    exit_code = 2


def usable_gpus(gpus: Sequence[Gpu]) -> list[Gpu]:
    """The cards gpushare slices: MIG cards are skipped, each with one log line."""
    usable = []
    for gpu in gpus:
        if gpu.mig_enabled:
            log.warning(
                "gpu_skipped_mig",
                gpu=gpu.uuid,
                index=gpu.index,
                name=gpu.name,
                reason="MIG-enabled GPUs are not sliced by gpushare",
            )
            continue
        usable.append(gpu)
    return usable


def prepare_enforcement(settings: Settings) -> Enforcement:
    if settings.no_enforcement:
        log.warning(
            "enforcement_disabled",
            detail="--no-enforcement: containers get limits as env only, nothing enforces them",
        )
        return Enforcement(library=None, preload_file=None, use_ld_preload_env=False)
    try:
        library = install_library(Path(settings.library), Path(settings.host_lib_dir))
        preload_file = (
            install_preload_file(library) if settings.preload in ("file", "both") else None
        )
        ensure_lock_dir()
    except (LibraryError, OSError) as exc:
        raise StartupError(str(exc)) from None
    log.info("library_installed", path=str(library), preload=settings.preload)
    return Enforcement(
        library=library,
        preload_file=preload_file,
        use_ld_preload_env=settings.preload in ("env", "both"),
    )


def check_message_sizes(inventory: Inventory) -> None:
    """Refuse a unit size whose device lists would not fit well inside the kubelet's
    4 MiB gRPC limit (a ListAndWatch message carries every unit of a resource)."""
    allowed = MESSAGE_SIZE_ALLOWED
    for resource in Resource:
        message = device_list_message(inventory, resource, lambda _uuid: True)
        count = len(message.devices)
        # Worst case: every device "Unhealthy", two bytes longer than "Healthy".
        size = message.ByteSize() + 2 * count
        if size <= allowed:
            continue
        unit = inventory.memory_unit_mib
        per_device = size / count
        suggested = 1 << unit.bit_length()  # the next power of two above the unit
        while (
            per_device * sum(card.gpu.memory_mib // suggested for card in inventory.cards.values())
            > allowed
        ):
            suggested *= 2
        raise ConfigurationTooLarge(
            f"the {resource.value} device list of {len(inventory)} GPUs would be "
            f"{size / (1 << 20):.1f} MiB ({count} units of {unit} MiB), more than the "
            f"{allowed / (1 << 20):.0f} MiB allowed under the kubelet's 4 MiB gRPC message "
            f"limit; use a larger memory unit: --memory-unit-mib {suggested} or more"
        )


class Daemon:
    """One node's plugin: two resources, their servers, and the link to the kubelet."""

    def __init__(
        self,
        settings: Settings,
        backend: GpuBackend | None = None,
        specs: PodSpecBook | None = None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.specs = specs
        self.stopping = threading.Event()
        self.servers: list[PluginServer] = []
        self.link: KubeletLink | None = None
        self.inventory: Inventory | None = None
        self.binder: Binder | None = None
        self.health: HealthBoard | None = None
        self.pod_resources: PodResourcesClient | None = None
        self.api_link: ApiLink | None = None
        self.usage: UsageLedger | None = None
        self.monitor: HealthMonitor | None = None
        self.refresher: UsageRefresher | None = None
        self.metrics: Metrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.waiting_for = ""  # why the GPUs could not be read, while starting

    def _open_gpus(self) -> tuple[GpuBackend, list[Gpu]]:
        """NVML (or the simulated node) and the usable GPUs. NVML that cannot be
        initialised, or that fails to list the cards, is not fatal: a driver still loading
        or a card not yet ready is retried with growing delays (each failure logged)
        until it works or the daemon is stopped. A crash loop would help nothing, so
        /healthz stays alive meanwhile and ``gpushare_ready`` is 0. With
        ``--fail-on-init-error`` the first failure ends the start instead. A simulated
        node file with a mistake in it is fatal at once."""
        if self.backend is None and self.settings.simulate:
            try:  # a file someone wrote: waiting will not fix it
                self.backend = open_backend(self.settings.simulate)
            except GpuError as exc:
                raise StartupError(str(exc)) from None
        delay, longest = DISCOVERY_RETRY_SECONDS
        attempt = 0
        while True:
            try:
                if self.backend is None:
                    self.backend = open_backend(self.settings.simulate)
                return self.backend, usable_gpus(self.backend.discover())
            except GpuError as exc:
                if self.settings.fail_on_init_error:
                    raise StartupError(str(exc)) from None
                attempt += 1
                self.waiting_for = f"attempt {attempt} failed, next in {delay:g} s: {exc}"
                log.error(
                    "gpu_discovery_failed", error=str(exc), attempt=attempt, retry_seconds=delay
                )
            if self.stopping.wait(delay):
                raise StartupError("stopped while waiting for the GPUs to become readable")
            delay = min(delay * 2, longest)

    def liveness(self) -> tuple[bool, str]:
        """What /healthz answers (see :func:`gpushare.metrics.liveness`)."""
        link = self.link
        if link is None and not self.stopping.is_set():
            # Still starting: waiting for NVML or the GPUs, which a restart would not fix.
            return True, f"starting; {self.waiting_for}" if self.waiting_for else "starting"
        # The link thread restarts a server whose socket vanished; a server down for
        # that moment is not a reason to be restarted, a dead link thread is.
        serving = not self.stopping.is_set() and link is not None and link.alive()
        state = LinkState(
            serving=serving,
            registered=link is not None and link.registered.is_set(),
            unregistered_seconds=link.unregistered_seconds() if link is not None else 0.0,
            kubelet_present=self.settings.kubelet_socket.exists(),
        )
        return liveness(state)

    def readiness(self) -> tuple[bool, str]:
        """What /readyz answers: ready while the GPUs are served and both resources are
        registered with the kubelet. A rollout waits for this; liveness does not."""
        link = self.link
        if self.stopping.is_set():
            return False, "stopping"
        if link is None:
            return False, f"starting; {self.waiting_for}" if self.waiting_for else "starting"
        if not link.registered.is_set():
            return False, "serving; not registered with the kubelet"
        return True, "serving and registered"

    def start(self) -> None:
        """Serve both resources and register them. Returns once serving (registration
        goes on in the background); waits, with /healthz alive, while the GPUs cannot be
        read. Raises :class:`StartupError`, everything started so far stopped again,
        when the configuration cannot work or the daemon is stopped while waiting."""
        try:
            self._start()
        except StartupError:
            self._stop()  # quietly: the caller reports the one line that matters
            raise

    def _start(self) -> None:
        settings = self.settings
        if settings.metrics_port:
            self._serve_metrics()  # first, so that the probe is answered while waiting
        backend, gpus = self._open_gpus()
        try:
            inventory = Inventory(gpus, settings.memory_unit_mib)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        check_message_sizes(inventory)
        self.inventory = inventory
        enforcement = prepare_enforcement(settings)
        health = HealthBoard(inventory.cards)
        self.health = health
        usage = UsageLedger(inventory)
        self.usage = usage
        self.pod_resources = PodResourcesClient(
            Path(settings.pod_resources_socket),
            {resource.name_with(settings.resource_prefix): resource for resource in Resource},
        )
        collector = GarbageCollector(
            Path(settings.host_lib_dir), settings.gc_grace_seconds, enforcement.library
        )
        def after_read(snapshot: Snapshot) -> None:
            if collector.maybe_collect(snapshot) is not None:
                return_free_memory()  # at most once a minute: after a burst, not during

        refresher = UsageRefresher(
            self.pod_resources.list,
            usage,
            settings.pod_resources_interval_seconds,
            after_read=after_read,
        )
        self.refresher = refresher
        if settings.node_name:
            self.specs = self.specs or PodSpecBook(settings.resource_prefix)
            self.api_link = ApiLink(
                settings.node_name,
                settings.resource_prefix,
                inventory,
                usage,
                health,
                self.specs,
                self.pod_resources,
            )
        self.binder = Binder(
            inventory,
            usage,
            health,
            policy=settings.placement,
            enforcement=enforcement,
            host_lib_dir=Path(settings.host_lib_dir),
            records=self.pod_resources,
            specs=self.specs,
            on_allocated=self._allocated,
        )
        # The kubelet's records first: the first placement after a restart respects them.
        if refresher.refresh_once():
            log.info("usage_recovered", **self._usage_summary(usage))
        for card in inventory.cards.values():
            log.info(
                "gpu_found",
                gpu=card.uuid,
                index=card.gpu.index,
                name=card.gpu.name,
                memory_mib=card.gpu.memory_mib,
                memory_units=card.memory_units,
                numa_node=card.gpu.numa_node,
            )
        self.monitor = HealthMonitor(
            backend,
            health,
            HealthPolicy(
                inventory.cards, settings.ignored_xid_set(), settings.health_recovery_seconds
            ),
        )
        self.monitor.start()
        if settings.metrics_port:
            self.metrics = Metrics(
                inventory,
                usage,
                health,
                {resource: resource.name_with(settings.resource_prefix) for resource in Resource},
                pod_resources_reads=lambda: (refresher.reads, refresher.failures),
            )
        kubelet_dir = Path(settings.kubelet_dir)
        named_servers = []
        for resource in Resource:
            servicer = DevicePluginServicer(
                resource,
                self.binder,
                health,
                self.stopping,
                observe=self.metrics.observe if self.metrics is not None else None,
            )
            server = PluginServer(servicer, kubelet_dir / resource.socket_name)
            self.servers.append(server)
            named_servers.append((server, resource.name_with(settings.resource_prefix)))
        try:
            kubelet_dir.mkdir(parents=True, exist_ok=True)
            for server in self.servers:
                server.start()
        except (OSError, RuntimeError) as exc:
            raise StartupError(f"cannot serve in {kubelet_dir}: {exc}") from None
        self.link = KubeletLink(settings.kubelet_socket, named_servers)
        self.link.start()
        if self.api_link is not None:
            self.api_link.start()
        refresher.start()

    def _serve_metrics(self) -> None:
        settings = self.settings
        server = MetricsServer(
            self._render_metrics,
            self.liveness,
            settings.metrics_address,
            settings.metrics_port,
            ready=self.readiness,
        )
        try:
            server.start()
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {settings.metrics_address}:{settings.metrics_port}:"
                f" {exc.strerror or exc}; set --metrics-port (0 = off)"
            ) from None
        self.metrics_server = server

    def _render_metrics(self) -> bytes:
        metrics = self.metrics
        return metrics.render() if metrics is not None else render_not_ready()

    @staticmethod
    def _usage_summary(usage: UsageLedger) -> dict[str, dict[str, int]]:
        return {
            f"{resource.value}_used": {u: n for u, n in usage.used_counts(resource).items() if n}
            for resource in Resource
        }

    def _allocated(self, resource: Resource, uuid: str, device_ids: Sequence[str]) -> None:
        if self.refresher is not None:
            self.refresher.poke()
        if self.api_link is not None:
            self.api_link.notify_allocated(resource, uuid, device_ids[0])

    def stop(self) -> None:
        self._stop()
        log.info("stopped")

    def _stop(self) -> None:
        self.stopping.set()
        if self.link is not None:  # first: streams end below, which must not re-register
            self.link.stop()
        if self.health is not None:
            self.health.wake()
        if self.monitor is not None:
            self.monitor.stop()
        if self.refresher is not None:
            self.refresher.stop()
        if self.api_link is not None:
            self.api_link.stop()
        for server in self.servers:
            server.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.pod_resources is not None:
            self.pod_resources.close()
        if self.backend is not None:
            self.backend.close()


#: glibc's mallopt parameter for the number of malloc arenas.
_M_ARENA_MAX = -8


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Ask glibc for at most ``arenas`` malloc arenas (it makes up to 8 per core, one per
    busy thread, each keeping freed memory). The gRPC worker threads otherwise grow
    the idle footprint by megabytes. True if glibc took it; a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def return_free_memory() -> bool:
    """Give the heap's free pages back to the system (glibc ``malloc_trim``): after a
    burst of requests they would otherwise stay in the resident size for good. True
    if glibc released some; a no-op elsewhere."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    limit_malloc_arenas()
    try:
        settings = load_settings(argv)
    except ConfigError as exc:
        print(f"gpushare-device-plugin: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    daemon = Daemon(settings)
    done = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal_received", signal=signal.Signals(signum).name)
        done.set()
        daemon.stopping.set()  # also ends a start that is still waiting for the GPUs

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
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
    done.wait()
    daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
