"""Device-plugin grants whose host side a reboot took, made again from the kubelet's records.

The kubelet keeps each Allocate answer in its checkpoint (on disk) and, for a container
of a pod it admitted before, reuses it: after a reboot it asks the plugin nothing for
such a container (v1.36 ``devicesToAllocate``: devices already allocated, plugin
registered and healthy, nothing needed). But a reboot empties every tmpfs: the daemon's
CDI directory (``--dra-cdi-dir``, ``/var/run/cdi``), where under a ``cdi-*`` strategy each
grant's spec ``<prefix>-grant_<name>.json`` is, which the answer names
(``<prefix>/grant=<name>``); and the cache tmpfs on ``<host-lib-dir>/containers``, where
each memory grant's cache directory ``c-<hex>`` is, which the answer (``envvar``) or the
spec mounts. A CDI name that resolves to nothing fails the container's creation; a CDI
mount of a missing source too (runc: no such file or directory). containerd (v2.4
``WithMounts``) makes a missing source of a CRI mount itself, 0755 and root's: the
container starts, but a non-root tenant cannot write its accounting file there.

What the daemon can know of a holding is what PodResources lists: the pod, the container,
the resource and its device IDs. That is enough to plan the grant again exactly as its
Allocate did, with the same pure functions: a share's card is the card of its unit IDs
(one, by construction: a container on two cards was refused), its memory limit the units
times the unit size (which cannot have changed while a container holds memory units:
``host/unitguard.py`` refuses the start), its cores the count; its spec name the digest
of the units (``grant_name``), its cache directory the digest too (``cache_key``). An
exclusive grant's devices are resolved from their IDs in the resource's order and given
the resource's own answer; its spec name is ``exclusive_grant_name``. Under unchanged
settings the spec written again is the one first written; under changed ones (another
interposer build, another enforcement backend) it holds the same card and the same limits
the way the node enforces them now. Never another card, never a larger limit: both come
from the IDs the kubelet holds for that container, and a holding that cannot be planned
so (an ID of a card no longer served, units on two cards) is logged and left.

Decided first (:func:`plan_restores`, pure, over :class:`OnNode`, the facts read), then
applied by :class:`GrantRestorer`: at the front door's start, from the records read at
start, before any server serves; then after every records read, for holdings listed
later (a restarted kubelet lists its pods as it admits them again). Only what is missing
is made: a spec or a directory that is there is never rewritten nor made afresh (a
running container may use it), a cache directory made by the runtime is given the
daemon's mode in place.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from gpushare.deviceplugin.shareplan import plan_share
from gpushare.host.grants import GrantHost, HostGrantError, HostNeeds
from gpushare.host.grantspecs import exclusive_grant_name, grant_name
from gpushare.host.library import cache_key, repair_cache_dir
from gpushare.share.answers import ContainerEdits, DeviceListing, Enforcement
from gpushare.share.devices import InvalidDeviceIds, Inventory, Resource
from gpushare.share.pairing import Binding
from gpushare.share.records import Snapshot
from gpushare.share.unitindex import UnitIndex
from gpushare.share.usage import Holder
from gpushare.share.whole import ExclusiveDevice, ExclusiveResource

log = structlog.get_logger(__name__)

#: An exclusive resource's devices and its answer (before sealing), by full name.
ExclusiveAnswers = Mapping[
    str, tuple[ExclusiveResource, Callable[[Sequence[ExclusiveDevice]], ContainerEdits]]
]


@dataclass(frozen=True)
class Regrant:
    """One container's holding of one resource, planned again (plain data)."""

    holder: Holder
    resource: str  # its full name
    spec_name: str  # the grant's CDI spec (written where the node seals answers)
    edits: ContainerEdits  # before sealing
    needs: HostNeeds | None  # its host side: a cache directory, an MPS namespace
    #: made first among its container's grants: a share's memory (its MPS namespace is
    #: made by the memory grant and capped by the core grant)
    first: bool = False

    @property
    def order(self) -> tuple[str, str, str, bool]:
        return (self.holder.namespace, self.holder.pod, self.holder.container, not self.first)


@dataclass(frozen=True)
class OnNode:
    """What the node holds now (facts, read before the plan)."""

    specs: frozenset[str]  # the grant specs on disk, by name
    present: frozenset[Path]  # of the directories the grants need, those there
    #: of those, the cache directories whose mode is not the daemon's (a runtime made them)
    foreign: frozenset[Path] = frozenset()


@dataclass(frozen=True)
class Restore:
    """What to make again for one holding, and what was found missing."""

    regrant: Regrant
    lost: tuple[str, ...]
    spec: bool = False  # write the grant's spec again
    needs: HostNeeds | None = None  # the part of its host side to make again
    repair: str | None = None  # a cache directory's key to give the daemon's mode in place


def _paths(needs: HostNeeds | None) -> list[Path]:
    if needs is None:
        return []
    paths = [p for p in (needs.cache_dir, needs.mps_pipe) if p is not None]
    return paths


def _missing(needs: HostNeeds, present: frozenset[Path]) -> HostNeeds | None:
    cache = (
        needs.cache_dir if needs.cache_dir is not None and needs.cache_dir not in present else None
    )
    pipe_lost = needs.mps_pipe is not None and needs.mps_pipe not in present
    if cache is None and not pipe_lost:
        return None
    return replace(needs, cache_dir=cache, keep=True, mps=needs.mps if pipe_lost else None)


def plan_restores(regrants: Iterable[Regrant], found: OnNode, *, seals: bool) -> list[Restore]:
    """What to make again of each holding's grant, given what is there (``found``) and
    whether the node seals answers in grant specs (``seals``: a CDI strategy). The
    holdings of one container come memory first: the MPS namespace its memory grant
    makes is capped by its core grant after. Pure."""
    restores = []
    namespaces_lost: set[Holder] = set()
    ordered = sorted(regrants, key=lambda r: r.order)
    for regrant in ordered:
        lost = []
        spec = seals and regrant.spec_name not in found.specs
        if spec:
            lost.append(f"spec {regrant.spec_name}")
        needs = None
        if regrant.needs is not None:
            needs = _missing(regrant.needs, found.present)
            if needs is not None and needs.cache_dir is not None:
                lost.append(f"cache directory {needs.key}")
            if needs is not None and needs.mps is not None:
                lost.append(f"MPS namespace {needs.key}")
                namespaces_lost.add(regrant.holder)
            elif regrant.needs.mps is not None and regrant.holder in namespaces_lost:
                needs = replace(regrant.needs, cache_dir=None)  # re-cap the new namespace
        repair = None
        cache = regrant.needs.cache_dir if regrant.needs is not None else None
        if cache is not None and cache in found.foreign:
            repair = cache.name
            lost.append(f"cache directory {cache.name} made by another (mode)")
        if lost or needs is not None:
            restores.append(Restore(regrant, tuple(lost), spec, needs, repair))
    return restores


class GrantRestorer:
    """Plans the grants of the holdings the kubelet lists again and makes what is missing
    of them (see the module's doc)."""

    def __init__(
        self,
        inventory: Inventory,
        enforcement: Enforcement,
        listing: DeviceListing | None,
        host: GrantHost,
        exclusive: ExclusiveAnswers,
        resource_prefix: str,
    ) -> None:
        self.inventory = inventory
        self.enforcement = enforcement
        self.listing = listing
        self.host = host
        self.exclusive = exclusive
        self.prefix = resource_prefix
        #: holdings that could not be planned, already logged: (holder, resource, IDs)
        self._told: set[tuple[Holder, str, tuple[str, ...]]] = set()
        self._units = UnitIndex(inventory)

    # ------------------------------------------------------------------ the plan
    def _share(
        self, resource: Resource, ids: Sequence[str], partner: Sequence[str] | None
    ) -> Regrant:
        grouped = self._units.group(resource, ids)
        if len(grouped) != 1:
            raise InvalidDeviceIds(f"{len(grouped)} cards hold its units")
        ((uuid, numbers),) = grouped.items()
        plan = plan_share(
            resource,
            uuid,
            numbers,
            ids,
            enforcement=self.enforcement,
            unit_mib=self.inventory.memory_unit_mib,
            dirs=self.host.plan_dirs(),
            mps=self.host.mps is not None,
            listing=self.listing,
            partner=Binding(resource.other, uuid, tuple(partner), 0.0) if partner else None,
        )
        needs = None if plan.needs.nothing else plan.needs
        nobody = Holder("", "", "")  # the caller names the holder
        name = resource.name_with(self.prefix)
        first = resource is Resource.MEMORY
        return Regrant(nobody, name, plan.spec_name, plan.edits, needs, first)

    def suspects(self) -> Callable[[str, str | None], bool]:
        """Whether a holding may miss something of its grant, from two directory listings
        (cheap: this runs after every records read, and almost always finds everything
        there): its spec's name not on disk where answers are sealed, its cache directory
        or that directory's record (which the daemon writes beside each it makes) not in
        the cache root; with MPS namespaces every memory holding (its pipe is elsewhere).
        Called with the grant's spec name and, for a memory grant, its cache key."""
        specs = self.host.specs
        names = specs.names_on_disk() if self.host.seals and specs is not None else None
        try:
            cached = set(os.listdir(self.host.dirs.cache_dir("x").parent))
        except OSError:
            cached = set()
        mps = self.host.mps is not None and self.host.plan_dirs().mps_namespaces is not None

        def suspect(spec_name: str, key: str | None) -> bool:
            if names is not None and spec_name not in names:
                return True
            return key is not None and (mps or key not in cached or f"{key}.json" not in cached)

        return suspect

    def regrants(
        self, snapshot: Snapshot, suspect: Callable[[str, str | None], bool] = lambda *_: True
    ) -> list[Regrant]:
        """Every holding of the records that ``suspect`` names, planned again (one that
        cannot be is logged, once while it is listed)."""
        planned: list[Regrant] = []
        for holder, held in snapshot.devices.items():
            for resource, ids in held.items():
                key = cache_key(ids) if resource is Resource.MEMORY else None
                if not ids or not suspect(grant_name(resource.value, ids), key):
                    continue
                try:
                    regrant = self._share(resource, ids, held.get(resource.other))
                except InvalidDeviceIds as exc:
                    self._unplanned(holder, resource.name_with(self.prefix), ids, str(exc))
                    continue
                planned.append(replace(regrant, holder=holder))
        for name, owners in snapshot.exclusive.items():
            served = self.exclusive.get(name)
            by_holder: dict[Holder, list[str]] = {}
            for device_id, holder in owners.items():
                by_holder.setdefault(holder, []).append(device_id)
            for holder, ids in by_holder.items():
                spec_name = exclusive_grant_name(name, ids)
                if not suspect(spec_name, None):
                    continue
                if served is None:
                    self._unplanned(holder, name, ids, "the resource is not served here now")
                    continue
                devices, answer = served
                try:
                    edits = answer(devices.resolve(ids))
                except InvalidDeviceIds as exc:
                    self._unplanned(holder, name, ids, str(exc))
                    continue
                planned.append(Regrant(holder, name, spec_name, edits, None))
        return planned

    def _unplanned(self, holder: Holder, resource: str, ids: Sequence[str], why: str) -> None:
        told = (holder, resource, tuple(sorted(ids)))
        if told in self._told:
            return
        self._told.add(told)
        log.warning(
            "grant_not_rebuilt",
            pod=f"{holder.namespace}/{holder.pod}",
            container=holder.container,
            resource=resource,
            reason=why,
        )

    # ------------------------------------------------------------------ the facts
    def on_node(self, regrants: Sequence[Regrant]) -> OnNode:
        specs = self.host.specs
        names = frozenset(specs.names_on_disk()) if specs is not None else frozenset()
        present, foreign = set(), set()
        for regrant in regrants:
            for path in _paths(regrant.needs):
                try:
                    info = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISDIR(info.st_mode):
                    continue  # made afresh (what stands there is buried)
                present.add(path)
                needs = regrant.needs
                cache = needs.cache_dir if needs is not None else None
                if path == cache and stat.S_IMODE(info.st_mode) != 0o777:
                    foreign.add(path)
        return OnNode(names, frozenset(present), frozenset(foreign))

    # ------------------------------------------------------------------ apply
    def restore(self, snapshot: Snapshot | None) -> list[Restore]:
        """Make again what the holdings ``snapshot`` lists miss; what was made."""
        if snapshot is None:
            return []
        listed = {
            (h, r.name_with(self.prefix)) for h, held in snapshot.devices.items() for r in held
        }
        listed |= {
            (h, name) for name, owners in snapshot.exclusive.items() for h in owners.values()
        }
        self._told = {t for t in self._told if (t[0], t[1]) in listed}  # told once while listed
        regrants = self.regrants(snapshot, self.suspects())
        if not regrants:
            return []
        restores = plan_restores(regrants, self.on_node(regrants), seals=self.host.seals)
        for restore in restores:
            self._apply(restore)
        return restores

    def _apply(self, restore: Restore) -> None:
        regrant = restore.regrant
        where = {
            "pod": f"{regrant.holder.namespace}/{regrant.holder.pod}",
            "container": regrant.holder.container,
            "resource": regrant.resource,
        }
        try:
            if restore.needs is not None:
                self.host.make(restore.needs)
            if restore.repair is not None:
                repair_cache_dir(self.host.dirs.lib_dir, restore.repair)
            if restore.spec:
                self.host.seal(regrant.edits, regrant.spec_name)
        except (HostGrantError, OSError, ValueError) as exc:
            log.error("grant_rebuild_failed", **where, error=str(exc))
            return
        log.warning("grant_rebuilt", **where, lost=list(restore.lost))
