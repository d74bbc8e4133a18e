"""The node's shared core, assembled from the settings and what discovery found.

Everything a front door stands on and nothing that speaks its protocol: the card modes
and the inventory of units, the enforcement every answer carries, the health boards,
the usage and whole-card ledgers with the shared/whole exclusion, the kubelet's records
and the refresher that keeps the usage ledger in step with them, the host's janitors
(garbage collector and reaper), and, with a node name, the API link with the pod specs
and GPU-model choices. :func:`build_core` only builds; :func:`core_parts` and
:func:`late_parts` are the parts that run it, started around the front doors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from gpushare.base.kubeletgrpc import socket_identity
from gpushare.base.memory import return_free_memory
from gpushare.base.parts import Part, Task
from gpushare.base.startup import ConfigurationRefused, NodeConfigurationError, StartupError
from gpushare.config import Settings
from gpushare.gpu import mig
from gpushare.gpu.gpus import Gpu, MigDevice
from gpushare.gpu.health import HealthBoard, HealthMonitor, HealthPolicy
from gpushare.host.gc import GarbageCollector
from gpushare.host.grantspecs import GrantSpecs
from gpushare.host.library import cache_root
from gpushare.host.mps import MpsControl, MpsError, MpsGrants, mps_shm_dir
from gpushare.host.mpsshm import MpsShm, clients_live
from gpushare.host.tombstones import Reaper
from gpushare.host.unitguard import UnitSizeChanged, guard_unit_size
from gpushare.kube.labels import LabelFacts
from gpushare.kube.nodestate import DraClaimState
from gpushare.kube.podspecs import PodSpecBook, holder_live
from gpushare.node.backendfacts import (
    DEVICE_PLUGIN_HOOKS,
    card_traits,
    decide_backends,
    shown_enforcement,
)
from gpushare.node.cardfacts import CardFacts
from gpushare.node.discovery import Discovered
from gpushare.node.enforcement import device_listing, prepare_enforcement, with_backends
from gpushare.node.podresources import PodResourcesClient
from gpushare.node.refresh import UsageRefresher
from gpushare.node.releases import watch_releases
from gpushare.share.answers import DeviceListing, Enforcement
from gpushare.share.backendchoice import Choice, ComputeBackend
from gpushare.share.cardmodes import (
    CardMode,
    card_modes,
    parse_card_modes,
    replicas_for,
    timeslice_cards,
)
from gpushare.share.devices import Inventory, Resource
from gpushare.share.exclusion import Exclusion
from gpushare.share.gputype import ChoiceBook
from gpushare.share.records import Snapshot
from gpushare.share.restartholders import RestartHolders
from gpushare.share.usage import UsageLedger
from gpushare.share.whole import (
    TIME_SLICED_RESOURCE,
    ExclusiveDevice,
    ExclusiveLedger,
    ExclusiveResource,
    time_sliced,
    whole_cards,
)

if TYPE_CHECKING:  # imported when used: the API link only runs with a node name
    from gpushare.kube.apilink import ApiLink

log = structlog.get_logger(__name__)

#: (full resource name, resource, the board its devices are offered from)
WholeResource = tuple[str, ExclusiveResource, HealthBoard]


@dataclass
class NodeCore:
    """The state every front door shares; built once by :func:`build_core`."""

    settings: Settings
    found: Discovered
    modes: dict[str, CardMode]
    inventory: Inventory
    enforcement: Enforcement
    listing: DeviceListing  # how every front door names cards and MIG devices
    health: HealthBoard  # the cards' own health
    mig_health: HealthBoard  # MIG cards and devices, by UUID (see health.expand)
    availability: HealthBoard  # whether each card's shared units can be offered now
    usage: UsageLedger
    whole: list[WholeResource]
    pod_resources: PodResourcesClient
    collector: GarbageCollector
    monitor: HealthMonitor
    card_facts: CardFacts  # whole holders, own health, unshared cards: annotation and metrics
    reaper: Reaper | None = None
    exclusion: Exclusion | None = None
    exclusive_ledger: ExclusiveLedger = field(default_factory=ExclusiveLedger)
    #: who held units before a kubelet restart, until the records list them again
    restart: RestartHolders = field(default_factory=RestartHolders)
    specs: PodSpecBook | None = None
    #: each card's enforcement backends and why (node/backendfacts.py), by UUID
    backends: dict[str, Choice] = field(default_factory=dict)
    #: the node's MPS control daemon and its containers' namespaces, where a card's
    #: compute is MPS's
    mps: MpsGrants | None = None
    #: keeps the usage ledger in step with the kubelet's records; its hooks are the
    #: core's own (built in :meth:`__post_init__`)
    refresher: UsageRefresher = field(init=False)
    choices: ChoiceBook | None = field(default=None, init=False)
    api_link: ApiLink | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.refresher = UsageRefresher(
            self.pod_resources.list,
            self.usage,
            self.settings.pod_resources_interval_seconds,
            after_read=self.after_read,
            read_listeners=[self.records_read_after_restart],
            # After a kubelet restart: read at once, then every second until the records
            # list every container again (the extender keeps pods off the node until then).
            hurry=lambda: bool(self.restart.restarted_at()),
        )
        self.restart.listeners.append(self.refresher.poke)

    def link_to_api(self, link: ApiLink, choices: ChoiceBook) -> None:
        """With a node name: the API link and the GPU-model choices its pod watch keeps."""
        self.api_link, self.choices = link, choices
    #: the /dev/shm the MPS daemons and clients share: measured and swept at each GC pass
    mps_shm: MpsShm | None = None

    @property
    def no_gpus(self) -> bool:
        """No card and no MIG device to serve at all."""
        found = self.found
        return not found.gpus and not found.mig_plan.mig_devices and not found.dra_mig_cards

    def physical_cards(self) -> list[Gpu]:
        """Every card this node serves in some way (what the ``gpu.count`` label counts):
        whole cards, cards in MIG mode under the device plugin, then under DRA."""
        found = self.found
        return (
            [g for g in found.gpus if not g.parent_uuid]
            + list(found.mig_plan.mig_cards)
            + found.dra_mig_cards
        )

    def records_read_after_restart(self, snapshot: Snapshot) -> None:
        """Feed :attr:`restart` each records read (a pod the spec book no longer holds,
        or holds as being deleted, is gone)."""
        specs = self.specs
        alive = partial(holder_live, specs) if specs is not None else None
        kubelet = socket_identity(Path(self.settings.kubelet_socket))
        given_up = self.restart.records_read(snapshot.holders_by_card(), alive, kubelet)
        if given_up:
            log.warning("kubelet_restart_holders_given_up", holders=given_up)

    def shared_allocated(self, resource: Resource, uuid: str, device_ids: Sequence[str]) -> None:
        """A front door answered shared units on card ``uuid``: tell whoever counts."""
        if self.exclusion is not None:
            self.exclusion.refresh()
        self.refresher.poke()
        if self.api_link is not None:
            self.api_link.notify_allocated(resource, uuid, device_ids[0])

    def whole_allocated(self, name: str, devices: Sequence[ExclusiveDevice]) -> None:
        """A front door answered whole devices of ``name`` (full resource name)."""
        self.exclusive_ledger.record(name, [d.id for d in devices])
        if self.exclusion is not None:
            self.exclusion.refresh()
        self.refresher.poke()
        if self.api_link is not None:
            self.api_link.notify_exclusive_allocated(name, [d.id for d in devices])

    def state_changed(self) -> None:
        """Something shown in the node's state changed (a DRA claim prepared or
        unprepared): publish it again."""
        if self.api_link is not None:
            self.api_link.notify_changed()

    def dra_serving(
        self,
        published: Mapping[str, tuple[int, int]],
        claims: Callable[[], Mapping[str, Sequence[DraClaimState]]],
        cache_holders: Callable[[], dict[str, str]],
    ) -> None:
        """The DRA driver serves: what it publishes of each card and the claims on them
        (the card facts, for the node's state and metrics), and who holds each claim's
        cache directory (named by the garbage collector when one is over its limit)."""
        self.card_facts.serve_dra(published, claims)
        self.collector.sizes.name_claim_holders_with(cache_holders)

    def after_read(self, snapshot: Snapshot) -> None:
        """Each fresh read of the kubelet's records: whole cards held, and the GC."""
        if self.exclusion is not None:
            self.exclusive_ledger.replace(snapshot.exclusive, snapshot.taken_at)
            self.exclusion.refresh()
        if self.collector.maybe_collect(snapshot) is not None:
            if self.mps is not None:  # the namespaces of containers whose units were freed
                self.mps.collect()
            if self.mps_shm is not None:
                self.sweep_mps_shm(snapshot)
            return_free_memory()  # at most once a minute: after a burst, not during

    def sweep_mps_shm(self, snapshot: Snapshot) -> None:
        """Measure the MPS /dev/shm; sweep it while no MPS client lives (host/mpsshm.py)."""
        assert self.mps_shm is not None
        mps_cards = {u for u, c in self.backends.items() if c.compute is ComputeBackend.MPS}
        namespaces = len(self.mps.control.caps()) if self.mps is not None else 0
        claims = self.card_facts.dra_claims() if self.card_facts.dra_claims else None
        live = clients_live(snapshot, mps_cards, namespaces, claims)
        self.mps_shm.pass_(clients_live=live, now=time.time())


def _modes_and_inventory(
    settings: Settings, found: Discovered
) -> tuple[dict[str, CardMode], Inventory]:
    gpus = found.gpus
    mig_cards = list(found.mig_plan.mig_cards)
    try:
        spec = parse_card_modes(settings.card_modes)
        modes = card_modes(
            [g for g in gpus if not g.parent_uuid] + found.dra_mig_cards + mig_cards, spec
        )
        for card in mig_cards:  # served by --mig-strategy: only dra may take one away
            given = spec.get(card.uuid, spec.get(str(card.index)))
            if given in (CardMode.SHARED, CardMode.EXCLUSIVE):
                raise ValueError(
                    f"cardModes puts card {card.index} ({card.uuid}) in {given.value} mode, "
                    "but it is in MIG mode: its MIG devices are served by --mig-strategy, "
                    "or by the DRA driver with mode dra"
                )
        modes.update({g.uuid: CardMode.SHARED for g in gpus if g.parent_uuid})  # migSharing
    except ValueError as exc:
        raise NodeConfigurationError(str(exc)) from None
    try:
        inventory = Inventory([g for g in gpus if modes[g.uuid].shared], settings.memory_unit_mib)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return modes, inventory


def build_core(
    settings: Settings, found: Discovered, specs: PodSpecBook | None = None
) -> NodeCore:
    """Build the core (nothing started); :class:`StartupError` when it cannot work.

    Each object is built with what it needs, in the order they need each other; the
    hooks between them (the refresher's, the kubelet-restart listeners) are the core's
    own methods, given at construction (:meth:`NodeCore.__post_init__`)."""
    modes, inventory = _modes_and_inventory(settings, found)
    if not found.gpus and not found.mig_plan.mig_devices and not found.dra_mig_cards:
        log.warning(
            "no_usable_gpus",
            detail="no GPU to serve: none found by NVML, or all in MIG mode and not "
            "served; serving empty device lists, /readyz answers 503",
        )
    prepared = prepare_enforcement(settings)
    listing = device_listing(settings, found.gpus, found.mig_plan, found.dra_mig_cards)
    backends, enforcement = _card_enforcement(settings, found, modes, listing, prepared)
    whole = _whole_resources(settings, found, modes)
    boards = _health_boards(found, inventory, whole)
    availability = boards.availability
    usage = UsageLedger(inventory)
    mig_prefix = mig.resource_prefix(settings.mig_nvidia_names, settings.resource_prefix)
    card_facts, pod_resources = _card_facts_and_records(
        settings, found, inventory, boards, whole, backends, mig_prefix
    )
    reaper, collector = _janitors(settings, enforcement.library, listing)
    exclusive_ledger = ExclusiveLedger()
    specs = _spec_book(settings, specs, mig_prefix)
    core = NodeCore(
        settings=settings,
        found=found,
        modes=modes,
        inventory=inventory,
        enforcement=enforcement,
        listing=listing,
        health=boards.health,
        mig_health=boards.mig,
        availability=availability,
        usage=usage,
        whole=whole,
        pod_resources=pod_resources,
        collector=collector,
        monitor=_health_monitor(settings, found, boards),
        card_facts=card_facts,
        reaper=reaper,
        exclusion=Exclusion(boards.health, availability, usage, whole, exclusive_ledger)
        if whole
        else None,
        exclusive_ledger=exclusive_ledger,
        specs=specs,
        backends=backends,
        mps=_mps_grants(settings, backends),
        mps_shm=_mps_shm(settings, backends),
    )
    if settings.node_name:
        assert specs is not None
        _link_to_api(core, specs)
    return core


def _spec_book(
    settings: Settings, given: PodSpecBook | None, mig_prefix: str
) -> PodSpecBook | None:
    """The pod specs the doors read: the book handed in (the fast suite's, made before
    the settings were final: it learns the prefix of the MIG resources a container must
    not mix with units), else, with a node name, one the API link's pod watch fills."""
    if given is not None:
        given.name_mig_resources_under(mig_prefix)
        return given
    return PodSpecBook(settings.resource_prefix, mig_prefix) if settings.node_name else None


def _card_enforcement(
    settings: Settings,
    found: Discovered,
    modes: dict[str, CardMode],
    listing: DeviceListing,
    prepared: Enforcement,
) -> tuple[dict[str, Choice], Enforcement]:
    """Each card's enforcement backends (node/backendfacts.py) and the enforcement every
    answer carries (``prepared``: the node's, before the backends), with them."""
    traits = card_traits(
        found.gpus,
        [*found.mig_plan.mig_cards, *found.dra_mig_cards],
        modes,
        uses_cdi=DEVICE_PLUGIN_HOOKS and listing.uses_cdi,
    )
    backends = decide_backends(settings, found.backend, traits)
    serves_dra = any(mode is CardMode.DRA for mode in modes.values())
    totals = {g.uuid: g.memory_mib for g in found.gpus}
    enforcement = with_backends(prepared, settings, backends, found.backend, serves_dra, totals)
    return backends, enforcement


@dataclass(frozen=True)
class _Boards:
    health: HealthBoard  # the cards' own health (and the MIG devices of DRA's MIG cards)
    mig: HealthBoard  # MIG cards and devices served by the device plugin, by UUID
    #: a card in MIG mode given to DRA -> its MIG devices
    dra_mig_of: dict[str, tuple[MigDevice, ...]]
    availability: HealthBoard  # whether each card's shared units can be offered now


def _health_boards(found: Discovered, inventory: Inventory, whole: list[WholeResource]) -> _Boards:
    # The cards' own health; a card in MIG mode given to DRA brings its MIG devices too
    # (the DRA driver publishes each, and an XID naming its GPU instance is its alone).
    dra_mig_of = {card.uuid: card.mig_devices for card in found.dra_mig_cards}
    health = HealthBoard(
        [g.uuid for g in found.gpus + found.dra_mig_cards]
        + [d.uuid for devices in dra_mig_of.values() for d in devices]
    )
    # With whole cards, shared units are offered from the cards' health and from
    # whether a card is held whole (see exclusion.py).
    availability = health
    if whole:
        availability = HealthBoard(inventory.cards, event="gpu_offer_changed", level="info")
    return _Boards(
        health, HealthBoard(mig.health_keys(found.mig_plan)), dra_mig_of, availability
    )


def _whole_resources(
    settings: Settings, found: Discovered, modes: dict[str, CardMode]
) -> list[WholeResource]:
    """Whole cards and time-sliced replicas: exclusive devices of resources of their own."""
    whole: list[WholeResource] = []
    if settings.whole_cards:
        resource = whole_cards(g for g in found.gpus if modes[g.uuid].exclusive)
        board = HealthBoard(resource.devices, event="gpu_offer_changed", level="info")
        whole.append((resource.name_with(settings.resource_prefix), resource, board))
    sliced = timeslice_cards([g for g in found.gpus if not g.parent_uuid], modes)
    if sliced:  # time-sliced replicas: exclusive devices of their own resource
        counts = {g.uuid: replicas_for(g, settings.time_slice_replicas) for g in sliced}
        resource = time_sliced(sliced, counts)
        board = HealthBoard(resource.devices, event="gpu_offer_changed", level="info")
        whole.append((resource.name_with(settings.resource_prefix), resource, board))
    return whole


def _card_facts_and_records(
    settings: Settings,
    found: Discovered,
    inventory: Inventory,
    boards: _Boards,
    whole: list[WholeResource],
    backends: dict[str, Choice],
    mig_prefix: str,
) -> tuple[CardFacts, PodResourcesClient]:
    """The card facts (holders, each card's own health, cards not shared) and the
    kubelet's records they read: each needs the other (the facts name the exclusive
    resources the client reads; the facts read the client's last records)."""
    plan = found.mig_plan
    card_facts = CardFacts(
        [g for g in found.gpus if not g.parent_uuid] + list(plan.mig_cards) + found.dra_mig_cards,
        inventory.cards,
        plan,
        boards.health,
        boards.mig,
        lambda: pod_resources.last,
        mig_prefix,
        replicas={d.id: d.parent for _n, r, _b in whole if r.name == TIME_SLICED_RESOURCE
                  for d in r.devices.values()},
        enforcement=shown_enforcement(backends),
    )
    pod_resources = PodResourcesClient(
        Path(settings.pod_resources_socket),
        {resource.name_with(settings.resource_prefix): resource for resource in Resource},
        exclusive=[name for name, _r, _b in whole] + card_facts.exclusive_resource_names(),
    )
    return card_facts, pod_resources


def _janitors(
    settings: Settings, library: Path | None, listing: DeviceListing
) -> tuple[Reaper | None, GarbageCollector]:
    """The host's janitors: the reaper of buried cache directories (with an interposer)
    and the garbage collector."""
    reaper = Reaper(cache_root(Path(settings.host_lib_dir))) if library is not None else None
    collector = GarbageCollector(
        Path(settings.host_lib_dir),
        settings.gc_grace_seconds,
        library,
        size_limit_bytes=settings.cache_dir_limit_mib << 20,
        lock_dir=library is not None,
        on_pass=reaper.retry if reaper is not None else None,
        grant_specs=GrantSpecs(
            Path(settings.dra_cdi_dir), settings.resource_prefix, settings.gc_grace_seconds
        )
        if listing.uses_cdi
        else None,
    )
    return reaper, collector


def _health_monitor(settings: Settings, found: Discovered, boards: _Boards) -> HealthMonitor:
    return HealthMonitor(
        found.backend,
        boards.health,
        HealthPolicy(
            boards.health.cards() + boards.mig.cards(),
            settings.ignored_xid_set(),
            settings.health_recovery_seconds,
        ),
        mig_of={**found.mig_plan.mig_of(), **boards.dra_mig_of},
        mig_board=boards.mig,
    )


def _mps_grants(settings: Settings, backends: dict[str, Choice]) -> MpsGrants | None:
    """The node's MPS control daemon and its containers' namespaces, where a card's
    compute is MPS's."""
    if ComputeBackend.MPS not in {c.compute for c in backends.values()}:
        return None
    control = MpsControl(Path(settings.mps_control), Path(settings.host_lib_dir))
    return MpsGrants(control, Path(settings.host_lib_dir))


def _mps_shm(settings: Settings, backends: dict[str, Choice]) -> MpsShm | None:
    """The /dev/shm the node's MPS daemons and clients share, bounded like the cache
    directories (``--cache-dir-limit-mib``), where a card's compute is MPS's."""
    if ComputeBackend.MPS not in {c.compute for c in backends.values()}:
        return None
    return MpsShm(
        mps_shm_dir(Path(settings.host_lib_dir)), limit_bytes=settings.cache_dir_limit_mib << 20
    )


def _link_to_api(core: NodeCore, specs: PodSpecBook) -> None:
    """With a node name: the API link (node state, pod annotations, the pod watch that
    keeps the pod specs and the GPU-model choices current)."""
    from gpushare.kube.apilink import ApiLink  # HTTP client and pod watch: only with a node

    settings, plan = core.settings, core.found.mig_plan
    prefix = settings.resource_prefix
    driver = getattr(core.found.backend, "cuda_driver_version", None)
    link = ApiLink(
        settings.node_name,
        prefix,
        core.inventory,
        core.usage,
        core.availability,
        specs,
        core.pod_resources.list,
        extra_labels=mig.labels(plan, prefix),
        state_mode=settings.node_state,
        label_facts=LabelFacts(
            gpus=core.physical_cards(),
            cuda_driver=driver() if driver is not None else None,
            nvidia_product=settings.nvidia_product_label,
            enforcement=core.card_facts.enforcement,
        ),
        card_extras=core.card_facts.extras,
        restart=core.restart,
        opt_in_label=settings.opt_in_label,
    )
    core.restart.listeners.append(link.notify_changed)  # published at once
    choices = ChoiceBook(
        prefix,
        [r.name_with(prefix) for r in Resource] + [name for name, _r, _b in core.whole],
        on_miss=link.refresh_pods_now,
    )
    link.pod_listeners.append(choices.replace_all)
    watch_releases(core.refresher, link)  # freed units published within about a second
    core.link_to_api(link, choices)


class PodResourcesPart:
    """The ``pod-resources`` part: at start, the kubelet's records are read once so that
    the first placement after a restart respects them, and the unit size is checked
    against them; at stop, the client is closed."""

    name = "pod-resources"

    def __init__(self, core: NodeCore) -> None:
        self.core = core

    def start(self) -> None:
        core = self.core
        if core.exclusion is not None:
            core.exclusion.refresh()
        recovered = core.refresher.refresh_once()
        try:
            guard_unit_size(
                Path(core.settings.host_lib_dir),
                core.settings.memory_unit_mib,
                core.pod_resources.last if recovered else None,
                {uuid: card.memory_units for uuid, card in core.inventory.cards.items()},
            )
        except UnitSizeChanged as exc:
            core.pod_resources.close()
            raise ConfigurationRefused(str(exc)) from None
        if recovered:
            log.info("usage_recovered", **usage_summary(core.usage))
        log_found(core)

    def stop(self) -> None:
        """Close the client; on a node opted out (the API link read it at its stop, the
        device-plugin servers are gone), first remove from the host directory what no
        container the kubelet lists now can use (``host/optout.py``)."""
        core = self.core
        try:
            if core.api_link is not None and core.api_link.opted_out:
                snapshot = core.pod_resources.list()
                if snapshot is None:
                    log.warning("uninstall_skipped", why="the kubelet's records cannot be read")
                else:
                    from gpushare.host.optout import remove_leftovers  # once, at uninstall

                    remove_leftovers(Path(core.settings.host_lib_dir), snapshot)
        finally:
            core.pod_resources.close()

    def ready(self) -> tuple[bool, str]:
        return True, ""


class MpsPart:
    """The ``mps-control`` part: the node's MPS control daemon, supervised
    (:mod:`gpushare.host.mps`); a daemon that will not start stops the start."""

    name = "mps-control"

    def __init__(self, control: MpsControl) -> None:
        self.control = control

    def start(self) -> None:
        try:
            self.control.start()
        except (MpsError, OSError) as exc:
            raise StartupError(f"the MPS control daemon: {exc}") from None

    def stop(self) -> None:
        self.control.stop()

    def ready(self) -> tuple[bool, str]:
        if not self.control.alive():
            return False, "the MPS control daemon is not running (restarting)"
        return True, ""


def usage_summary(usage: UsageLedger) -> dict[str, dict[str, int]]:
    return {
        f"{resource.value}_used": {u: n for u, n in usage.used_counts(resource).items() if n}
        for resource in Resource
    }


def log_found(core: NodeCore) -> None:
    for card in core.inventory.cards.values():
        log.info(
            "gpu_found",
            gpu=card.uuid,
            index=card.gpu.index,
            name=card.gpu.name,
            memory_mib=card.gpu.memory_mib,
            memory_units=card.memory_units,
            numa_node=card.gpu.numa_node,
        )
    plan = core.found.mig_plan
    log.info(
        "mig_strategy",
        strategy=core.settings.mig_strategy,
        mig_resources={n: len(d) for n, d in plan.exclusive.items()},
        mig_sliced=len(plan.shared_mig),
    )


def core_parts(core: NodeCore) -> list[Part]:
    """The parts started before the front doors, in order."""
    parts: list[Part] = [PodResourcesPart(core)]
    if core.mps is not None:  # before the front doors: a cap needs the control daemon
        parts.append(MpsPart(core.mps.control))
    if core.reaper is not None:  # deletes buried cache directories (tombstones.py)
        parts.append(Task("reaper", core.reaper.start, core.reaper.stop))
    parts.append(Task("health-monitor", core.monitor.start, core.monitor.stop))
    return parts


def late_parts(core: NodeCore) -> list[Part]:
    """The parts started after the front doors serve: the API link, then the refresher."""
    parts: list[Part] = []
    if core.api_link is not None:
        parts.append(Task("api-link", core.api_link.start, core.api_link.stop))
    parts.append(Task("usage-refresher", core.refresher.start, core.refresher.stop))
    return parts
