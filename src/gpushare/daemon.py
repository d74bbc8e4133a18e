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
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import structlog

from gpushare.base.buildinfo import build_info
from gpushare.base.logs import configure_logging
from gpushare.config import ConfigError, Settings, effective_config, load_settings_with_origins
from gpushare.deviceplugin import migserve
from gpushare.deviceplugin.binding import RECORDS_WAIT, Binder, mixed_kinds
from gpushare.deviceplugin.exclusive import ExclusiveServicer, Preference, answer_builder
from gpushare.deviceplugin.kubelet import KubeletLink
from gpushare.deviceplugin.plugin import DevicePluginServicer, PluginServer, device_list_message
from gpushare.gpu import mig
from gpushare.gpu.gpus import Gpu, GpuBackend, GpuError, open_backend
from gpushare.gpu.gputype import CardChoice, ChoiceBook
from gpushare.gpu.health import HealthBoard, HealthMonitor, HealthPolicy
from gpushare.gpu.mig import MigPlan, MigPlanError, MigStrategy
from gpushare.gpu.topology import Topology, prefer
from gpushare.host.cdi import CdiCheck
from gpushare.host.elf import NotASharedObject, check_shared_object
from gpushare.host.gc import CacheDirMetrics, GarbageCollector
from gpushare.host.library import (
    LibraryError,
    cache_root,
    ensure_cache_root,
    ensure_lock_dir,
    install_library,
    install_preload_file,
)
from gpushare.host.tombstones import Reaper
from gpushare.host.unitguard import UnitSizeChanged, guard_unit_size
from gpushare.kube.labels import LabelFacts
from gpushare.kube.podspecs import PodSpecBook
from gpushare.node.podresources import PodResourcesClient
from gpushare.node.refresh import UsageRefresher
from gpushare.node.releases import watch_releases
from gpushare.share.answers import DeviceListing, Enforcement
from gpushare.share.cardmodes import CardMode, card_modes, parse_card_modes
from gpushare.share.devices import Inventory, Resource
from gpushare.share.exclusion import Exclusion
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder, UsageLedger
from gpushare.share.whole import ExclusiveDevice, ExclusiveLedger, ExclusiveResource, whole_cards

if TYPE_CHECKING:  # imported when used: the metrics server and the API link are optional
    from gpushare.kube.apilink import ApiLink
    from gpushare.ops.metrics import Metrics, MetricsServer

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


class ConfigurationRefused(StartupError):
    """The settings cannot work on this node: exit 2, like a bad value."""

    exit_code = 2


class NodeConfigurationError(ConfigurationRefused):
    """The settings do not fit this node's GPUs (e.g. cardModes names no such card)."""


class BadKubeletDir(ConfigurationRefused):
    """The kubelet's device-plugin directory is not there: a wrong path or mount."""


class ConfigurationTooLarge(ConfigurationRefused):
    """The settings cannot work on this node's GPUs (e.g. too many device IDs)."""


def plan_gpus(gpus: Sequence[Gpu], strategy: str, sharing: bool = False) -> MigPlan:
    """The cards gpushare slices and the MIG devices it serves (see mig.py); each card
    left out gets one log line. :class:`NodeConfigurationError` where the strategy
    cannot serve this node (``single`` on MIG devices of several profiles)."""
    try:
        result = mig.plan(gpus, MigStrategy(strategy), sharing=sharing)
    except MigPlanError as exc:
        raise NodeConfigurationError(str(exc)) from None
    for skipped in result.skipped:
        log.warning(
            "gpu_skipped",
            gpu=skipped.gpu.uuid,
            index=skipped.gpu.index,
            name=skipped.gpu.name,
            reason=skipped.reason,
        )
    return result


class BadLibrary(ConfigurationRefused):
    """``--library`` names a file that cannot enforce anything on this node."""


def check_library(path: Path) -> None:
    """Refuse an interposer that is not an ELF shared object of this node's machine; a
    missing file is left to the installer's own message."""
    try:
        check_shared_object(path)
    except OSError:
        return
    except NotASharedObject as exc:
        raise BadLibrary(
            f"--library {path} is {exc}: it would be preloaded and silently ignored, and "
            "no limit enforced; point --library at HAMi-core's libvgpu.so for this "
            "architecture, or run with --no-enforcement"
        ) from None


def prepare_enforcement(settings: Settings) -> Enforcement:
    if settings.no_enforcement:
        log.warning(
            "enforcement_disabled",
            detail="--no-enforcement: containers get limits as env only, nothing enforces them",
        )
        return Enforcement(library=None, preload_file=None, use_ld_preload_env=False)
    check_library(Path(settings.library))
    try:
        library = install_library(Path(settings.library), Path(settings.host_lib_dir))
        preload_file = (
            install_preload_file(library) if settings.preload in ("file", "both") else None
        )
        ensure_cache_root(Path(settings.host_lib_dir))
    except (LibraryError, OSError) as exc:
        raise StartupError(str(exc)) from None
    lock_dir = ensure_lock_dir(Path(settings.host_lib_dir))  # never fails start
    log.info("library_installed", path=str(library), preload=settings.preload)
    return Enforcement(
        library=library,
        preload_file=preload_file,
        use_ld_preload_env=settings.preload in ("env", "both"),
        lock_dir=lock_dir,
    )


def device_listing(settings: Settings, gpus: Sequence[Gpu]) -> DeviceListing:
    """How answers name their cards (``--device-list-strategy`` and the CDI settings)."""
    by_index = settings.cdi_name_strategy == "index"
    return DeviceListing(
        strategies=settings.device_list_strategies(),
        cdi_kind=settings.cdi_kind,
        cdi_ids={g.uuid: str(g.index) for g in gpus} if by_index else {},
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
        self.health: HealthBoard | None = None  # the cards' own health
        self.offer: HealthBoard | None = None  # what the shared units are offered from
        self.exclusion: Exclusion | None = None
        self.choices: ChoiceBook | None = None
        self.exclusive_ledger = ExclusiveLedger()
        self.listing = DeviceListing()
        self.cdi: CdiCheck | None = None
        self.pod_resources: PodResourcesClient | None = None
        self.api_link: ApiLink | None = None
        self.usage: UsageLedger | None = None
        self.monitor: HealthMonitor | None = None
        self.refresher: UsageRefresher | None = None
        self.reaper: Reaper | None = None
        self.collector: GarbageCollector | None = None
        self.metrics: Metrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.waiting_for = ""  # why the GPUs could not be read, while starting
        self.mig_plan = MigPlan(MigStrategy(settings.mig_strategy), ())
        self.not_served = ""  # why nothing at all is served on this node (all MIG, ...)
        self.no_gpus = False  # no card and no MIG device to serve at all
        self.mig_health = HealthBoard(())  # MIG cards and devices, by UUID
        #: (name, stop) of every part started, in start order; stopped in reverse.
        self._parts: list[tuple[str, Callable[[], object]]] = []
        self._start_ms: dict[str, float] = {}

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts running, in start order (optional ones are absent when off)."""
        return tuple(name for name, _stop in self._parts)

    def _launch(self, name: str, start: Callable[[], object], stop: Callable[[], object]) -> None:
        """Start one part, timed, and remember how to stop it (:meth:`_stop`)."""
        began = time.perf_counter()
        start()
        self._parts.append((name, stop))
        self._start_ms[name] = round((time.perf_counter() - began) * 1000, 1)

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
                found = self.backend.discover()
                settings = self.settings
                self.mig_plan = plan_gpus(found, settings.mig_strategy, settings.mig_sharing)
                self.not_served = self.mig_plan.not_served(found)
                return self.backend, self.mig_plan.shared_gpus()
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
        """What /healthz answers (see :func:`gpushare.ops.metrics.liveness`)."""
        from gpushare.ops.metrics import LinkState, liveness

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
        if self.not_served:
            return False, f"serving nothing: {self.not_served}"
        missing = self.cdi.missing() if self.cdi is not None else []
        if missing:
            return False, f"serving, but these CDI devices are in no CDI spec: {', '.join(missing)}"
        if self.no_gpus:
            return False, "registered, but no usable GPU (none found, or all MIG-enabled)"
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
        began = time.perf_counter()
        if settings.metrics_port:
            self._serve_metrics()  # first, so that the probe is answered while waiting
        backend, gpus = self._open_gpus()
        try:
            modes = card_modes(
                [g for g in gpus if not g.parent_uuid], parse_card_modes(settings.card_modes)
            )
            modes.update({g.uuid: CardMode.SHARED for g in gpus if g.parent_uuid})  # migSharing
        except ValueError as exc:
            raise NodeConfigurationError(str(exc)) from None
        try:
            inventory = Inventory(
                [g for g in gpus if modes[g.uuid].shared], settings.memory_unit_mib
            )
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        check_message_sizes(inventory)
        self.inventory = inventory
        self.listing = listing = migserve.with_mig_names(
            device_listing(settings, gpus), self.mig_plan, settings.cdi_name_strategy == "index"
        )
        if listing.uses_cdi:
            named = [g.uuid for g in gpus] + [d.uuid for d in self.mig_plan.mig_devices]
            self.cdi = CdiCheck(settings.cdi_spec_paths(), [listing.cdi_name(u) for u in named])
            self.cdi.missing()  # logged now, at start
        self.no_gpus = not gpus and not self.mig_plan.mig_devices
        if self.no_gpus:
            log.warning(
                "no_usable_gpus",
                detail="no GPU to serve: none found by NVML, or all in MIG mode and not "
                "served; serving empty device lists, /readyz answers 503",
            )
        enforcement = prepare_enforcement(settings)
        health = HealthBoard(g.uuid for g in gpus)  # the cards' own health
        # MIG cards and devices: their own board (see health.expand), never sliced.
        self.mig_health = HealthBoard(migserve.health_keys(self.mig_plan))
        self.health = health
        usage = UsageLedger(inventory)
        self.usage = usage
        exclusive = self._exclusive_resources(gpus, modes)
        # What the shared resources are offered from: the cards' health, and with whole
        # cards also whether a card is held whole (see exclusion.py).
        offer = (
            HealthBoard(inventory.cards, event="gpu_offer_changed", level="info")
            if exclusive
            else health
        )
        self.offer = offer
        pod_resources = PodResourcesClient(
            Path(settings.pod_resources_socket),
            {resource.name_with(settings.resource_prefix): resource for resource in Resource},
            exclusive=[name for name, _r, _b in exclusive],
        )
        self.pod_resources = pod_resources
        self._launch("pod-resources", lambda: None, pod_resources.close)
        if enforcement.library is not None:
            # deletes buried cache directories in the background (tombstones.py)
            reaper = Reaper(cache_root(Path(settings.host_lib_dir)))
            self.reaper = reaper
            self._launch("reaper", reaper.start, reaper.stop)
        if exclusive:
            self.exclusion = Exclusion(health, offer, usage, exclusive, self.exclusive_ledger)
        collector = GarbageCollector(
            Path(settings.host_lib_dir),
            settings.gc_grace_seconds,
            enforcement.library,
            size_limit_bytes=settings.cache_dir_limit_mib << 20,
            lock_dir=enforcement.library is not None,
            on_pass=self.reaper.retry if self.reaper is not None else None,
        )
        self.collector = collector

        def after_read(snapshot: Snapshot) -> None:
            if self.exclusion is not None:
                self.exclusive_ledger.replace(snapshot.exclusive, snapshot.taken_at)
                self.exclusion.refresh()
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
            from gpushare.kube.apilink import ApiLink  # HTTP client and pod watch: only with a node

            self.api_link = ApiLink(
                settings.node_name,
                settings.resource_prefix,
                inventory,
                usage,
                offer,
                self.specs,
                self.pod_resources.list,
                extra_labels=mig.labels(self.mig_plan, settings.resource_prefix),
            )
            self.choices = ChoiceBook(
                settings.resource_prefix,
                [r.name_with(settings.resource_prefix) for r in Resource]
                + [name for name, _r, _b in exclusive],
            )
            self.choices.on_miss = self.api_link.refresh_pods_now
            watch_releases(refresher, self.api_link)  # freed units published promptly
            self.api_link.pod_listeners.append(self.choices.replace_all)
            driver = getattr(backend, "cuda_driver_version", None)
            self.api_link.label_facts = LabelFacts(
                gpus=[g for g in gpus if not g.parent_uuid] + list(self.mig_plan.mig_cards),
                cuda_driver=driver() if driver is not None else None,
                nvidia_product=settings.nvidia_product_label,
            )
        self.binder = Binder(
            inventory,
            usage,
            offer,
            policy=settings.placement,
            enforcement=enforcement,
            host_lib_dir=Path(settings.host_lib_dir),
            records=self.pod_resources,
            specs=self.specs,
            on_allocated=self._allocated,
        )
        if self.exclusion is not None:
            self.exclusion.refresh()
        # The kubelet's records first: the first placement after a restart respects them.
        recovered = refresher.refresh_once()
        try:
            guard_unit_size(
                Path(settings.host_lib_dir),
                settings.memory_unit_mib,
                self.pod_resources.last if recovered else None,
                {uuid: card.memory_units for uuid, card in inventory.cards.items()},
            )
        except UnitSizeChanged as exc:
            raise ConfigurationRefused(str(exc)) from None
        if recovered:
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
        log.info(
            "mig_strategy",
            strategy=settings.mig_strategy,
            mig_resources={n: len(d) for n, d in self.mig_plan.exclusive.items()},
            mig_sliced=len(self.mig_plan.shared_mig),
        )
        self.monitor = HealthMonitor(
            backend,
            health,
            HealthPolicy(
                health.cards() + self.mig_health.cards(),
                settings.ignored_xid_set(),
                settings.health_recovery_seconds,
            ),
            mig_of=self.mig_plan.mig_of(),
            mig_board=self.mig_health,
        )
        self._launch("health-monitor", self.monitor.start, self.monitor.stop)
        if settings.metrics_port:
            from gpushare.ops.metrics import Metrics

            self.metrics = Metrics(
                inventory,
                usage,
                health,
                {resource: resource.name_with(settings.resource_prefix) for resource in Resource},
                pod_resources_reads=lambda: (refresher.reads, refresher.failures),
                node=settings.node_name,
                ready=lambda: self.readiness()[0],
                registered=self._registered_resources,
            )
            self.metrics.registry.register(CacheDirMetrics(collector))
        kubelet_dir = Path(settings.kubelet_dir)
        named_servers = []
        for resource in Resource:
            servicer = DevicePluginServicer(
                resource,
                self.binder,
                offer,
                self.stopping,
                observe=self.metrics.observe if self.metrics is not None else None,
                listing=self.listing,
                choice=lambda r, n: self._choice(r.name_with(settings.resource_prefix), n),
            )
            server = PluginServer(servicer, kubelet_dir / resource.socket_name)
            self.servers.append(server)
            named_servers.append((server, resource.name_with(settings.resource_prefix)))
        if not kubelet_dir.is_dir():
            raise BadKubeletDir(
                f"--kubelet-dir {kubelet_dir} does not exist: it must be the kubelet's "
                "device-plugins directory (<kubelet root-dir>/device-plugins, e.g. "
                "/var/lib/kubelet/device-plugins; k0s: /var/lib/k0s/kubelet/device-plugins), "
                "mounted at the same path"
            )
        for name, devices, board in exclusive:
            exclusive_servicer = ExclusiveServicer(
                devices,
                name,
                board,
                self.stopping,
                answer=answer_builder(
                    self.listing,
                    enforcement=enforcement if settings.exclusive_enforcement else None,
                ),
                prefer=self._preference(devices, backend),
                on_allocated=self._exclusive_allocated,
                choice=lambda n, name=name: self._choice(name, n),  # type: ignore[misc]
                guard=lambda name=name: self._mixed_guard(name),  # type: ignore[misc]
            )
            server = PluginServer(exclusive_servicer, kubelet_dir / devices.socket_name)
            self.servers.append(server)
            named_servers.append((server, name))
        named_servers += self._mig_servers(self.mig_health, kubelet_dir)
        if self.not_served:
            log.error("nothing_served", reason=self.not_served)
        try:
            for server in self.servers:
                self._launch(f"server:{server.socket_path.name}", server.start, server.stop)
        except (OSError, RuntimeError) as exc:
            raise StartupError(f"cannot serve in {kubelet_dir}: {exc}") from None
        link = KubeletLink(settings.kubelet_socket, named_servers)
        self.link = link
        # Stopped before the servers: their streams end then, which must not re-register.
        self._launch("kubelet-link", link.start, link.stop)
        if self.api_link is not None:
            self._launch("api-link", self.api_link.start, self.api_link.stop)
        self._launch("usage-refresher", refresher.start, refresher.stop)
        log.info(
            "daemon_started",
            parts=list(self.parts),
            start_ms=self._start_ms,
            total_ms=round((time.perf_counter() - began) * 1000, 1),
        )

    def _serve_metrics(self) -> None:
        from gpushare.ops.metrics import MetricsServer  # prometheus_client, http.server

        settings = self.settings
        server = MetricsServer(
            self._render_metrics,
            self.liveness,
            settings.metrics_address,
            settings.metrics_port,
            ready=self.readiness,
        )
        try:
            self._launch("metrics-server", server.start, server.stop)
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {settings.metrics_address}:{settings.metrics_port}:"
                f" {exc.strerror or exc}; set --metrics-port (0 = off)"
            ) from None
        self.metrics_server = server

    def _registered_resources(self) -> dict[str, bool]:
        """Resource name -> registered with the kubelet now (all register together)."""
        link = self.link
        registered = link is not None and link.registered.is_set() and not self.stopping.is_set()
        prefix = self.settings.resource_prefix
        return {resource.name_with(prefix): registered for resource in Resource}

    def _render_metrics(self) -> bytes:
        metrics = self.metrics
        if metrics is not None:
            return metrics.render()
        from gpushare.ops.metrics import render_not_ready

        return render_not_ready()

    @staticmethod
    def _usage_summary(usage: UsageLedger) -> dict[str, dict[str, int]]:
        return {
            f"{resource.value}_used": {u: n for u, n in usage.used_counts(resource).items() if n}
            for resource in Resource
        }

    def _exclusive_resources(
        self, gpus: Sequence[Gpu], modes: Mapping[str, CardMode]
    ) -> list[tuple[str, ExclusiveResource, HealthBoard]]:
        """The exclusive resources to serve: (full name, resource, its offer board)."""
        if not self.settings.whole_cards:
            return []
        resource = whole_cards(g for g in gpus if modes[g.uuid].exclusive)
        board = HealthBoard(resource.devices, event="gpu_offer_changed", level="info")
        return [(resource.name_with(self.settings.resource_prefix), resource, board)]

    def _mig_servers(
        self, health: HealthBoard, kubelet_dir: Path
    ) -> list[tuple[PluginServer, str]]:
        """One server per MIG resource of the plan, offered from the hardware board
        (a MIG card is never sliced, so no other use competes for its devices)."""
        settings = self.settings
        prefix = migserve.NVIDIA_PREFIX if settings.mig_nvidia_names else settings.resource_prefix
        specs = migserve.read_device_specs(self.mig_plan) if settings.mig_device_specs else None
        named = []
        for name, devices in migserve.resources(self.mig_plan, prefix):
            servicer = ExclusiveServicer(
                devices,
                name,
                health,
                self.stopping,
                answer=migserve.answer_builder(self.listing, specs=specs),
            )
            server = PluginServer(servicer, kubelet_dir / migserve.socket_name(devices))
            self.servers.append(server)
            named.append((server, name))
        return named

    def _mixed_guard(self, name: str) -> str | None:
        """Refuse whole cards to a container being admitted that also holds shared
        units (the kubelet's fresh records and the pod specs must both say so)."""
        if self.specs is None or self.pod_resources is None:
            return None
        records = self.pod_resources.read_after(time.monotonic(), timeout=RECORDS_WAIT)
        if records is None:
            return None
        mixer = self.specs.mixer_being_admitted(records, exclusive=name)
        return mixed_kinds(mixer) if mixer is not None else None

    def _preference(self, resource: ExclusiveResource, backend: GpuBackend) -> Preference:
        """Whole cards: NVLink, then NUMA, then PCIe switch (see topology.py). A backend
        that cannot tell the topology leaves NUMA nodes and positions."""
        numa = {d.id: d.numa_node for d in resource.devices.values()}
        read = getattr(backend, "topology", None)
        try:
            known = read() if read is not None else Topology(numa=numa)
        except GpuError as exc:
            raise NodeConfigurationError(str(exc)) from None
        except Exception as exc:  # NVML: no topology is better than no plugin
            log.warning("gpu_topology_unreadable", error=str(exc))
            known = Topology(numa=numa)
        known = Topology(nvlinks=known.nvlinks, numa={**numa, **known.numa}, switch=known.switch)
        log.info(
            "gpu_topology",
            nvlinks={"+".join(sorted(p)): n for p, n in known.nvlinks.items()},
            pcie_switches=len(set(known.switch.values())),
        )
        position = {d.id: d.index for d in resource.devices.values()}

        def preference(
            available: Sequence[ExclusiveDevice], must: Sequence[ExclusiveDevice], size: int
        ) -> list[str]:
            return prefer([d.id for d in available], [d.id for d in must], size, known, position)

        return preference

    def _choice(self, full_name: str, units: int) -> CardChoice | None:
        """The use-gputype choice of the container now asking ``units`` of ``full_name``,
        when the pending pods tell it (see gputype.py); the kubelet's last records say
        which containers already hold theirs."""
        if self.choices is None:
            return None
        snapshot = self.pod_resources.last if self.pod_resources is not None else None
        shared = {r.name_with(self.settings.resource_prefix): r for r in Resource}

        def holds(key: tuple[str, str, str]) -> bool:
            if snapshot is None:
                return False
            holder = Holder(*key)
            if full_name in shared:
                return bool(snapshot.devices.get(holder, {}).get(shared[full_name]))
            return holder in snapshot.exclusive.get(full_name, {}).values()

        return self.choices.choice_for(full_name, units, holds)

    def _exclusive_allocated(self, name: str, devices: Sequence[ExclusiveDevice]) -> None:
        self.exclusive_ledger.record(name, [d.id for d in devices])
        if self.exclusion is not None:
            self.exclusion.refresh()
        if self.refresher is not None:
            self.refresher.poke()
        if self.api_link is not None:
            self.api_link.notify_changed()

    def _allocated(self, resource: Resource, uuid: str, device_ids: Sequence[str]) -> None:
        if self.exclusion is not None:
            self.exclusion.refresh()
        if self.refresher is not None:
            self.refresher.poke()
        if self.api_link is not None:
            self.api_link.notify_allocated(resource, uuid, device_ids[0])

    def stop(self) -> None:
        self._stop()
        log.info("stopped")

    def _stop(self) -> None:
        """Stop every part started, in the reverse order, then close the GPUs."""
        self.stopping.set()
        for board in (self.health, self.offer, self.mig_health):
            if board is not None:
                board.wake()  # waiters (streams included) see ``stopping`` at once
        while self._parts:
            _name, stop = self._parts.pop()
            stop()
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
