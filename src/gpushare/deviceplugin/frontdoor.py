"""The device-plugin front door: the kubelet's v1beta1 API over the node's shared core.

One :class:`DevicePluginFrontDoor` is one part of the daemon. It builds a server per
resource (the two shared ones, whole cards, time-sliced replicas, each MIG profile) over
the core's boards and ledgers, the :class:`~gpushare.deviceplugin.binding.Binder` that
binds a container's units to one card, and the
:class:`~gpushare.deviceplugin.registration.KubeletLink` that registers them; start
serves and registers, stop unregisters first (streams that end then must not
re-register) and then stops the servers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpushare.base.kubeletgrpc import CallHook
from gpushare.base.startup import (
    BadKubeletDir,
    ConfigurationTooLarge,
    NodeConfigurationError,
    StartupError,
)
from gpushare.deviceplugin import migserve, socketnames
from gpushare.deviceplugin.binding import RECORDS_WAIT, Binder
from gpushare.deviceplugin.exclusive import (
    EditsFor,
    ExclusiveServicer,
    Preference,
    sealed_by,
    time_sliced_answer,
    whole_card_answer,
)
from gpushare.deviceplugin.plugin import (
    DevicePluginServicer,
    ListingServicer,
    PluginServer,
    device_list_message,
)
from gpushare.deviceplugin.registration import KubeletLink
from gpushare.deviceplugin.restore import GrantRestorer
from gpushare.deviceplugin.stalesockets import remove_stale_sockets
from gpushare.gpu import mig
from gpushare.gpu.gpus import GpuBackend, GpuError
from gpushare.gpu.topology import Topology, prefer
from gpushare.host.cdi import CdiCheck
from gpushare.kube.specrefusals import mixed_kinds
from gpushare.node.core import NodeCore
from gpushare.share.devices import Inventory, Resource
from gpushare.share.gputype import CardChoice
from gpushare.share.usage import Holder
from gpushare.share.whole import (
    TIME_SLICED_RESOURCE,
    ExclusiveDevice,
    ExclusiveResource,
    spread_replicas,
)

log = structlog.get_logger(__name__)

#: The kubelet refuses gRPC messages above 4 MiB; a device list must fit well inside.
KUBELET_MESSAGE_LIMIT = 4 << 20
#: ...so a device list may take three quarters of it at most.
MESSAGE_SIZE_ALLOWED = KUBELET_MESSAGE_LIMIT * 3 // 4


@dataclass(frozen=True)
class LinkHealth:
    """What liveness needs to know of the kubelet link (see ``metrics.liveness``)."""

    serving: bool
    registered: bool
    unregistered_seconds: float


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
        cards = inventory.cards.values()
        while per_device * sum(card.gpu.allocatable_mib // suggested for card in cards) > allowed:
            suggested *= 2
        raise ConfigurationTooLarge(
            f"the {resource.value} device list of {len(inventory)} GPUs would be "
            f"{size / (1 << 20):.1f} MiB ({count} units of {unit} MiB), more than the "
            f"{allowed / (1 << 20):.0f} MiB allowed under the kubelet's 4 MiB gRPC message "
            f"limit; use a larger memory unit: --memory-unit-mib {suggested} or more"
        )


def check_kubelet_dir(path: Path) -> None:
    """:class:`BadKubeletDir` unless ``path`` is a directory. Checked before the GPUs are
    read too (the daemon), so that a wrong path is reported while NVML is missing."""
    if not path.is_dir():
        raise BadKubeletDir(
            f"--kubelet-dir {path} does not exist: it must be the kubelet's "
            "device-plugins directory (<kubelet root-dir>/device-plugins, e.g. "
            "/var/lib/kubelet/device-plugins; k0s: /var/lib/k0s/kubelet/device-plugins), "
            "mounted at the same path"
        )


class DevicePluginFrontDoor:
    """Every device-plugin resource of the node, served and registered with the kubelet."""

    name = "device-plugin"

    def __init__(
        self,
        core: NodeCore,
        stopping: threading.Event,
        observe: CallHook | None = None,
        kubelet_version: Callable[[], str] | None = None,
    ) -> None:
        settings = core.settings
        #: the kubelet's version where the daemon is told it (a simulated node); else
        #: read from the Node through the API link (:meth:`_kubelet_version`)
        self.kubelet_version = kubelet_version
        check_message_sizes(core.inventory)
        self.core, self.stopping = core, stopping
        plan = core.found.mig_plan
        self.listing = core.listing
        self.cdi: CdiCheck | None = None
        if self.listing.uses_cdi:
            uuids = [g.uuid for g in core.found.gpus] + [d.uuid for d in plan.mig_devices]
            names = [self.listing.cdi_name(u) for u in uuids]
            self.cdi = CdiCheck(settings.cdi_spec_paths(), names)
            self.cdi.missing()  # logged now, at start
        self.binder = Binder(
            core.inventory,
            core.usage,
            core.availability,
            policy=settings.placement,
            enforcement=core.enforcement,
            host_lib_dir=Path(settings.host_lib_dir),
            records=core.pod_resources,
            specs=core.specs,
            on_allocated=core.shared_allocated,
            listing=self.listing,
            restart=core.restart,
            grant_specs=core.collector.grant_specs,
            mps=core.mps,
        )
        self.kubelet_dir = Path(settings.kubelet_dir)
        #: this instance's part of every socket name it serves on (socketnames.py)
        self.token = socketnames.draw_token()
        self.servers: list[PluginServer] = []
        self.observe = observe
        #: every exclusive resource's devices and answer before sealing, by full name
        self._answers: dict[str, tuple[ExclusiveResource, EditsFor]] = {}
        self._named = [*self._shared_servers(), *self._whole_servers(), *self._mig_servers()]
        #: makes again what a reboot took of the grants the kubelet lists (restore.py)
        self.restorer = GrantRestorer(
            core.inventory,
            core.enforcement,
            self.listing,
            self.binder.host,
            self._answers,
            settings.resource_prefix,
        )
        #: Built when the servers serve: its directory watch holds descriptors, which a
        #: front door that never starts (a start-up that fails before it) must not.
        self.link: KubeletLink | None = None

    # ------------------------------------------------------------------ the servers
    def _serve(
        self, servicer: ListingServicer, socket_name: str, name: str
    ) -> tuple[PluginServer, str]:
        server = PluginServer(servicer, self.kubelet_dir, socket_name, self.token)
        self.servers.append(server)
        return server, name

    def _shared_servers(self) -> list[tuple[PluginServer, str]]:
        prefix = self.core.settings.resource_prefix
        return [
            self._serve(
                DevicePluginServicer(
                    resource,
                    self.binder,
                    self.core.availability,
                    self.stopping,
                    observe=self.observe,
                    choice=lambda r, n: self._choice(r.name_with(prefix), n),
                    full_name=resource.name_with(prefix),
                ),
                resource.socket_name,
                resource.name_with(prefix),
            )
            for resource in Resource
        ]

    def _whole_servers(self) -> list[tuple[PluginServer, str]]:
        core = self.core
        enforcement = core.enforcement if core.settings.exclusive_enforcement else None
        named = []
        for name, devices, board in core.whole:
            sliced = devices.name == TIME_SLICED_RESOURCE
            raw = (
                time_sliced_answer(self.listing)
                if sliced
                else whole_card_answer(self.listing, enforcement=enforcement)
            )
            self._answers[name] = (devices, raw)
            servicer = ExclusiveServicer(
                devices,
                name,
                board,
                self.stopping,
                answer=sealed_by(raw, name, self.binder.host),
                prefer=spread_replicas if sliced else self._preference(devices, core.found.backend),
                on_allocated=core.whole_allocated,
                observe=self.observe,
                choice=lambda n, name=name: self._choice(name, n),  # type: ignore[misc]
                guard=lambda name=name: self._mixed_guard(name),  # type: ignore[misc]
                most=1 if sliced else None,
            )
            named.append(self._serve(servicer, devices.socket_name, name))
        return named

    def _mig_servers(self) -> list[tuple[PluginServer, str]]:
        """One server per MIG resource of the plan, offered from the hardware board
        (a MIG card is never sliced, so no other use competes for its devices)."""
        settings, plan = self.core.settings, self.core.found.mig_plan
        prefix = mig.resource_prefix(settings.mig_nvidia_names, settings.resource_prefix)
        specs = migserve.read_device_specs(plan) if settings.mig_device_specs else None
        named = []
        for name, devices in migserve.resources(plan, prefix):
            raw = migserve.mig_answer(self.listing, specs=specs)
            self._answers[name] = (devices, raw)
            servicer = ExclusiveServicer(
                devices,
                name,
                self.core.mig_health,
                self.stopping,
                answer=sealed_by(raw, name, self.binder.host),
                on_allocated=self.core.whole_allocated,  # annotated and published as whole cards
                observe=self.observe,
                guard=lambda name=name: self._mixed_guard(name),  # type: ignore[misc]
            )
            named.append(self._serve(servicer, migserve.socket_name(devices), name))
        return named

    # ------------------------------------------------------------------ the part
    def start(self) -> None:
        check_kubelet_dir(self.kubelet_dir)
        if self.core.found.not_served:
            log.error("nothing_served", reason=self.core.found.not_served)
        # Before anything serves: what a reboot took of the grants the kubelet holds (it
        # reuses their answers for containers it starts again), from the records read at
        # start; then at every read, for holdings the kubelet lists later.
        try:
            self.restorer.restore(self.core.pod_resources.last)
        except Exception:  # the kubelet's records are data: nothing in them stops the start
            log.exception("grants_not_restored")
        self.core.refresher.read_listeners.append(self.restorer.restore)
        remove_stale_sockets(self.kubelet_dir, self.token)  # a killed instance's
        try:
            for server in self.servers:
                server.start()
            self.link = KubeletLink(
                self.core.settings.kubelet_socket, self._named, self._kubelet_version
            )
            self.link.on_restart.append(self.core.restart.kubelet_restarted)
            self.link.start()
        except (OSError, RuntimeError) as exc:
            self.stop()  # every server, the one that failed half-way too (a no-op if unstarted)
            raise StartupError(f"cannot serve in {self.kubelet_dir}: {exc}") from None

    def stop(self) -> None:
        with contextlib.suppress(ValueError):  # not there: a start that failed before it
            self.core.refresher.read_listeners.remove(self.restorer.restore)
        if self.link is not None:  # first: streams that end with the servers must not re-register
            self.link.stop()
        for server in reversed(self.servers):
            server.stop()

    def ready(self) -> tuple[bool, str]:
        if self.link is None or not self.link.registered.is_set():
            return False, "serving; not registered with the kubelet"
        if self.core.found.not_served:
            return False, f"serving nothing: {self.core.found.not_served}"
        missing = self.cdi.missing() if self.cdi is not None else []
        if missing:
            return False, f"serving, but these CDI devices are in no CDI spec: {', '.join(missing)}"
        if self.core.no_gpus:
            return False, "registered, but no usable GPU (none found, or all MIG-enabled)"
        return True, "serving and registered"

    def link_health(self) -> LinkHealth:
        # The link thread restarts a server whose socket vanished; a server down for
        # that moment is not a reason to be restarted, a dead link thread is.
        link = self.link
        if link is None:  # not serving yet
            return LinkHealth(serving=False, registered=False, unregistered_seconds=0.0)
        return LinkHealth(
            serving=not self.stopping.is_set() and link.alive(),
            registered=link.registered.is_set(),
            unregistered_seconds=link.unregistered_seconds(),
        )

    def _kubelet_version(self) -> str:
        """The kubelet's version ("v1.37.2"), from the Node's status as the API link last
        read it; "" where unknown (no API server): registration renewals then break before
        they make (``registration.make_before_break``)."""
        if self.kubelet_version is not None:
            return self.kubelet_version()
        link = self.core.api_link
        return link.publisher.kubelet_version if link is not None else ""

    def registered_resources(self) -> dict[str, bool]:
        """Resource name -> registered with the kubelet now (all register together)."""
        link = self.link
        registered = link is not None and link.registered.is_set() and not self.stopping.is_set()
        prefix = self.core.settings.resource_prefix
        return {resource.name_with(prefix): registered for resource in Resource}

    # ------------------------------------------------------------------ per request
    def _mixed_guard(self, name: str) -> str | None:
        """Refuse whole cards or MIG devices to a container being admitted that also
        holds shared units (the kubelet's fresh records and the pod specs must both say
        so)."""
        specs = self.core.specs
        if specs is None:
            return None
        records = self.core.pod_resources.read_after(time.monotonic(), timeout=RECORDS_WAIT)
        if records is None:
            return None
        mixer = specs.mixer_being_admitted(records, exclusive=name)
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
        choices = self.core.choices
        if choices is None:
            return None
        snapshot = self.core.pod_resources.last
        shared = {r.name_with(self.core.settings.resource_prefix): r for r in Resource}

        def holds(key: tuple[str, str, str]) -> bool:
            if snapshot is None:
                return False
            holder = Holder(*key)
            if full_name in shared:
                return bool(snapshot.devices.get(holder, {}).get(shared[full_name]))
            return holder in snapshot.exclusive.get(full_name, {}).values()

        return choices.choice_for(full_name, units, holds)
