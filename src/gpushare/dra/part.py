"""The DRA driver as one part of the daemon (see :mod:`gpushare.base.parts`).

:func:`build_dra_part` takes everything from the composition root, explicitly: the
settings, the cards in ``dra`` card mode, the node's health board, the enforcement and
device-listing decisions already made for the device plugin (the same answers, the
same interposer file), the host directory of the cache directories, an API client, the
node's name and the kubelet's root directory. The part then

* publishes the cards in the node's ResourceSlices (:mod:`gpushare.dra.slices`),
* serves the kubelet plugin (:mod:`gpushare.dra.kubeletplugin`) that prepares claims
  (:mod:`gpushare.dra.claims`),

and is ready once the slices are published with consumable capacity kept. What it has
prepared on each card (:meth:`DraPart.shares`) joins the node's published state and
metrics through the core (:meth:`DraPart.report_to`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from gpushare.base.kubeletgrpc import CallHook
from gpushare.base.startup import NodeConfigurationError
from gpushare.config import Settings
from gpushare.dra.claims import ClaimPreparer
from gpushare.dra.kubeletplugin import DraServer
from gpushare.dra.model import FULL_CORES, Offered, health_keys, offered_devices
from gpushare.dra.slices import SlicePublisher
from gpushare.gpu.gpus import Gpu
from gpushare.gpu.health import HealthBoard
from gpushare.gpu.pci import SYSFS_PCI_DEVICES, sysfs_bus_id
from gpushare.host.mignodes import read_mig_nodes
from gpushare.host.mps import MpsGrants
from gpushare.kube.nodestate import MAX_REQUEST, DraClaimState
from gpushare.kube.stdlibclient import ApiClient
from gpushare.node.core import NodeCore
from gpushare.share.answers import DeviceListing, Enforcement
from gpushare.share.cardmodes import dra_cards

log = structlog.get_logger(__name__)


def pcie_root(bus_id: str, sysfs: Path = SYSFS_PCI_DEVICES) -> str | None:
    """The PCIe root complex (``pci0000:3a``) of an NVML bus ID (``00000000:3B:00.0``),
    from sysfs; None where sysfs does not tell."""
    if not bus_id:
        return None
    try:
        target = os.path.realpath(sysfs / sysfs_bus_id(bus_id))
    except OSError:
        return None
    for part in Path(target).parts:
        if part.startswith("pci") and ":" in part:
            return part
    return None


class DraPart:
    """The DRA driver: slice publisher and kubelet plugin, started and stopped together."""

    name = "dra"

    def __init__(
        self,
        devices: Sequence[Offered],
        publisher: SlicePublisher,
        server: DraServer,
        preparer: ClaimPreparer,
        cards: Sequence[str] = (),
    ) -> None:
        self.devices = list(devices)
        self.cards = list(cards)  # the UUIDs of the cards served (some may publish nothing)
        self.publisher = publisher
        self.server = server
        self.preparer = preparer
        self._started = False

    def offering(self) -> str:
        """Why the devices are not offered yet, or "": only once the kubelet has
        registered the plugin can it prepare a claim (a pod placed before fails its
        first prepare, "driver ... is not registered", and waits for the kubelet's retry,
        about 90 s). Slices already in the API server (a daemon restart) are left as
        they are until then."""
        if self.server.registered:
            return ""
        if self.server.registered is False:
            return f"the kubelet refused the plugin: {self.server.registration_error}"
        return "waiting for the kubelet to register the DRA plugin"

    def start(self) -> None:
        self.preparer.tidy()
        self.publisher.gate = self.offering
        self.server.on_registered.append(self.publisher.poke)
        self.publisher.start()
        try:
            self.server.start()
        except BaseException:
            self.publisher.stop()
            raise
        self._started = True
        log.info(
            "dra_started",
            driver=self.publisher.driver,
            devices=[d.name for d in self.devices],
        )

    def stop(self) -> None:
        self.server.stop()
        self.publisher.stop()
        self.preparer.lock.close()
        self._started = False

    def ready(self) -> tuple[bool, str]:
        if not self._started:
            return False, "dra: not started"
        problem = self.publisher.problem()
        if problem:
            return False, f"dra: {problem}"
        if self.server.registered is False:
            return False, f"dra: the kubelet refused the plugin: {self.server.registration_error}"
        return True, "dra: slices published"

    def shares(self) -> dict[str, tuple[DraClaimState, ...]]:
        """Card UUID -> the devices of the claims prepared there, from the preparer's
        memory (no file I/O, no node lock). A claim recorded by a daemon that did not
        note sizes has them None, except on a MIG device (its size is the device's)."""
        offered = {d.name: d for d in self.devices}
        by_card: dict[str, list[DraClaimState]] = {}
        for entry in self.preparer.held.entries():
            for device in entry.devices:
                known = offered.get(device.device)
                card = device.card or (known.card_uuid if known is not None else "")
                if not card:
                    continue  # a device this node no longer offers, of an old entry
                memory, cores = device.memory_mib, device.cores
                if memory is None and known is not None and not known.shared:
                    memory, cores = known.memory_mib, 0
                by_card.setdefault(card, []).append(
                    DraClaimState(
                        entry.namespace,
                        entry.name,
                        device.request[:MAX_REQUEST],
                        device.device,
                        memory,
                        cores,
                    )
                )
        return {
            card: tuple(sorted(claims, key=lambda c: (c.namespace, c.claim, c.request, c.device)))
            for card, claims in by_card.items()
        }

    def cache_holders(self) -> dict[str, str]:
        """Claim cache key -> ``claim <namespace>/<name>`` of every claim held."""
        return {
            key: f"claim {entry.namespace}/{entry.name}"
            for entry in self.preparer.held.entries()
            for key in entry.cache_keys
        }

    def published(self) -> dict[str, tuple[int, int]]:
        """Card UUID -> the memory (MiB) and cores published of it in all: a card's
        rounded memory and 100 cores, or its MIG devices' memory together and no cores
        (a card publishing nothing, e.g. in MIG mode without MIG devices, is there too)."""
        totals: dict[str, tuple[int, int]] = {uuid: (0, 0) for uuid in self.cards}
        for device in self.devices:
            memory, cores = totals.get(device.card_uuid, (0, 0))
            shared_cores = FULL_CORES if device.shared else 0
            totals[device.card_uuid] = (memory + device.memory_mib, cores + shared_cores)
        return totals

    def report_to(self, core: NodeCore) -> None:
        """Show what is prepared in the node's state and metrics (the core's card
        facts), and have the API link publish again after each change."""
        core.dra_serving(self.published(), self.shares, self.cache_holders)
        self.preparer.held.on_change = core.state_changed


def build_dra_part(
    settings: Settings,
    gpus: Sequence[Gpu],
    board: HealthBoard,
    enforcement: Enforcement,
    listing: DeviceListing,
    host_lib_dir: Path,
    api: ApiClient,
    node_name: str,
    kubelet_root: Path,
    *,
    driver_version: str | None = None,
    pcie_roots: Mapping[str, str] | None = None,
    observe: CallHook | None = None,
    mps: MpsGrants | None = None,
    mig_nodes: Mapping[str, Sequence[str]] | None = None,
    watched_pod: Callable[[str], Mapping[str, Any] | None] | None = None,
) -> DraPart:
    """The DRA part for ``gpus`` (the cards in ``dra`` card mode; one in MIG mode is
    published as its MIG devices). ``board`` must hold every card of ``gpus`` by UUID,
    and each MIG device of those in MIG mode by its own.
    ``mig_nodes``: MIG UUID -> its device nodes (``--mig-device-specs``).
    ``watched_pod``: this node's pods by UID as the daemon's pod watch holds them
    (``PodWatch.claim_pod``): a claim's reserving pod found there is not read again.
    ``pcie_roots`` (card UUID -> root) default to what sysfs says."""
    if not node_name:
        raise ValueError("the DRA driver needs the node's name (NODE_NAME / --node-name)")
    devices = _devices(
        gpus, settings.memory_unit_mib, board, enforcement, driver_version, pcie_roots
    )
    driver = settings.dra_driver
    preparer = _preparer(
        settings, devices, board, enforcement, listing, host_lib_dir, api, node_name, mps,
        mig_nodes, watched_pod,
    )
    publisher = SlicePublisher(
        api=api,
        driver=driver,
        node=node_name,
        devices=lambda: devices,
        unit_mib=settings.memory_unit_mib,
        board=board,
        interval=settings.dra_resync_seconds,
    )
    server = DraServer(
        kubelet_root=kubelet_root,
        driver=driver,
        pool=node_name,
        preparer=preparer,
        devices=lambda: [(d.name, health_keys(d)) for d in devices],
        board=board,
        observe=observe,
    )
    return DraPart(devices, publisher, server, preparer, [g.uuid for g in gpus])


def _mig_nodes(cards: Sequence[Gpu]) -> dict[str, tuple[str, ...]]:
    """The device nodes of the MIG devices of ``cards`` (``--mig-device-specs``), as the
    device plugin's MIG door reads them."""
    return read_mig_nodes(cards, [d for g in cards for d in g.mig_devices])


def _preparer(
    settings: Settings,
    devices: Sequence[Offered],
    board: HealthBoard,
    enforcement: Enforcement,
    listing: DeviceListing,
    host_lib_dir: Path,
    api: ApiClient,
    node_name: str,
    mps: MpsGrants | None,
    mig_nodes: Mapping[str, Sequence[str]] | None,
    watched_pod: Callable[[str], Mapping[str, Any] | None] | None,
) -> ClaimPreparer:
    """The prepare side of the driver, its checkpoint in ``--dra-state-dir`` (default:
    ``dra`` under the host directory) and its claims' CDI specs in ``--dra-cdi-dir``."""
    by_name = {d.name: d for d in devices}
    state_dir = Path(settings.dra_state_dir) if settings.dra_state_dir else host_lib_dir / "dra"
    return ClaimPreparer(
        api=api,
        driver=settings.dra_driver,
        pool=node_name,
        devices=lambda: by_name,
        health=board,
        enforcement=enforcement,
        listing=listing,
        unit_mib=settings.memory_unit_mib,
        host_lib_dir=host_lib_dir,
        cdi_dir=Path(settings.dra_cdi_dir),
        state_dir=state_dir,
        mps=mps,
        mig_nodes=mig_nodes,
        watched_pod=watched_pod,
    )


def _devices(
    gpus: Sequence[Gpu],
    unit_mib: int,
    board: HealthBoard,
    enforcement: Enforcement,
    driver_version: str | None,
    pcie_roots: Mapping[str, str] | None,
) -> list[Offered]:
    """The devices the driver publishes of ``gpus``, each with its card's PCIe root and
    enforcement backends; a ValueError when ``board`` lacks one of their health keys."""
    roots = (
        dict(pcie_roots)
        if pcie_roots is not None
        else {g.uuid: r for g in gpus if (r := pcie_root(g.pci_bus_id)) is not None}
    )
    default = "interposer" if enforcement.library is not None else "none"
    backends = {
        g.uuid: (enforcement.memory.get(g.uuid, default), enforcement.compute.get(g.uuid, default))
        for g in gpus
    }
    devices = offered_devices(
        gpus, unit_mib, driver_version=driver_version, pcie_roots=roots, enforcement=backends
    )
    missing = sorted({k for d in devices for k in health_keys(d)} - set(board.cards()))
    if missing:
        raise ValueError(f"the health board holds no entry for {', '.join(missing)}")
    return devices


def dra_part_for(core: NodeCore, observe: CallHook | None = None) -> DraPart | None:
    """The DRA front door of this node's core: ``None`` when no card is in card mode
    ``dra``; :class:`NodeConfigurationError` when the driver cannot work here (no node
    name, no API server)."""
    from gpushare.kube.apilink import ApiConfigMissing, connect_api

    settings = core.settings
    cards = dra_cards(core.physical_cards(), core.modes)
    if not cards:
        return None
    try:
        part = build_dra_part(
            settings,
            cards,
            core.health,
            core.enforcement,
            core.listing,
            Path(settings.host_lib_dir),
            connect_api(),
            settings.node_name,
            Path(settings.dra_kubelet_root),
            observe=observe,
            mps=core.mps,
            mig_nodes=_mig_nodes(cards) if settings.mig_device_specs else None,
            watched_pod=core.api_link.pods.claim_pod if core.api_link is not None else None,
        )
    except (ValueError, ApiConfigMissing) as exc:
        raise NodeConfigurationError(f"card mode dra: {exc}") from None
    part.report_to(core)
    return part
