"""The host side of a grant: what a container needs on the node before it starts.

Every front door hands out grants (``share/answers.py``: which devices, whole or a
share, under the card's enforcement); some of them need something on the host first,
and this module is the one place that makes it, for every door, and undoes it:

* HAMi-core's cache directory, where the interposer counts the card's memory: a fresh
  directory in the private root (``host/library.py``), named after the container's
  units (the device plugin) or after the claim, its request and its device (DRA);
* the container's MPS namespace, where the card's compute is MPS's and the control
  daemon has namespaces (``host/mps.py``): made and capped before the container
  exists (fail closed: no cap, no grant), its marker directory in the private root;
* a DRA claim's holder directory, where the card's memory limit is the driver's
  (``host/claimholders.py``): the memory hook records there the one container that holds
  the share;
* the grant's own CDI spec (``host/grantspecs.py`` for a device-plugin grant under a
  CDI device-list strategy, ``host/cdi.py`` for a DRA claim, always): the edits
  written, the kubelet's answer sealed to name them (:func:`~gpushare.share.answers.sealed`).

Two halves. :func:`share_needs` is pure: from the grant's card, its limits, the
card's backends (:class:`~gpushare.share.answers.Enforcement`) and the node's
directories (:class:`NodeDirs`) it says what must exist (:class:`HostNeeds`) and
where, so a door computes the container's edits before anything is made.
:class:`GrantHost` makes it (:meth:`GrantHost.make`), writes and seals the spec
(:meth:`GrantHost.seal`, :meth:`GrantHost.write_claim_spec`) and undoes it
(:meth:`GrantHost.release`); every failure is one :class:`HostGrantError` with one
line, which the door turns into its refusal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpushare.host.cdi import CdiDevice, write_spec, write_spec_document
from gpushare.host.claimholders import holder_dir, make_holder_dir, release_holder_dir
from gpushare.host.grantspecs import GrantSpecs
from gpushare.host.library import (
    cache_root,
    prepare_cache_dir,
    prepare_claim_cache_dir,
    release_cache_dir,
)
from gpushare.host.mps import SERVER, MpsError, MpsGrants
from gpushare.share import answers
from gpushare.share.answers import ContainerEdits, DeviceListing, Enforcement


class HostGrantError(Exception):
    """A grant's host side could not be made; the message is one line."""


@dataclass(frozen=True)
class NodeDirs:
    """The node's directories a grant's host side lives in (plain data)."""

    #: the daemon's host directory (``--host-lib-dir``): the private root of the cache
    #: directories is below it
    lib_dir: Path
    #: ``<pipe>/<server>``, where the MPS server makes each namespace's directory, when
    #: the node's MPS control daemon has namespaces (v3); None otherwise
    mps_namespaces: Path | None = None

    def cache_dir(self, key: str) -> Path:
        return cache_root(self.lib_dir) / key

    def holder(self, key: str) -> Path:
        return holder_dir(self.lib_dir, key)


@dataclass(frozen=True)
class MpsNeed:
    """The container's MPS namespace on a card whose compute is MPS's.

    A device-plugin container has two answers (``claim`` False): the memory answer makes
    the namespace (``memory_mib`` set), the core answer caps it (``cores`` set);
    ``partner`` names the units of the other answer where it came first. A DRA claim's
    share (``claim`` True) makes and caps it at once."""

    memory_mib: int | None
    cores: int | None
    pinned: bool  # the card's memory is MPS's pinned limit (``soft``)
    partner: tuple[str, ...] | None = None
    claim: bool = False


@dataclass(frozen=True)
class HostNeeds:
    """What one grant needs on the host, and where it will be (pure data)."""

    key: str  # the grant's directory name (library.cache_key or claim_cache_key)
    units: tuple[str, ...] = ()  # a device-plugin grant's units (() for a claim)
    cache_dir: Path | None = None  # HAMi-core's cache directory, made fresh
    #: a recovered claim's cache directory, kept where it is still there (its running
    #: container may be using it); made fresh otherwise
    keep: bool = False
    mps: MpsNeed | None = None
    mps_pipe: Path | None = None  # the namespace's pipe directory the container mounts
    #: a claim's share of a ``driver`` card: the directory where the memory hook records
    #: the one container holding it (``host/claimholders.py``)
    holder: Path | None = None

    @property
    def nothing(self) -> bool:
        return self.cache_dir is None and self.mps is None and self.holder is None

    @property
    def made_keys(self) -> list[str]:
        """The keys of the private root's directories :meth:`GrantHost.make` makes (a
        claim's, released at unprepare; a device-plugin grant's are collected by GC)."""
        made = self.cache_dir is not None or (self.mps is not None and self.mps_pipe is not None)
        return [self.key] if made or self.holder is not None else []


def share_needs(
    enforcement: Enforcement,
    uuid: str,
    dirs: NodeDirs,
    *,
    key: str,
    memory_mib: int | None,
    cores: int | None,
    mps: bool,
    units: Sequence[str] = (),
    partner: Sequence[str] | None = None,
    claim: bool = False,
    keep: bool = False,
) -> HostNeeds:
    """What a share of card ``uuid`` needs on the host. Pure.

    ``memory_mib`` / ``cores``: the limits this grant carries (a device-plugin answer
    carries one of them, None the other; a claim both, ``cores`` None when none was
    asked). ``mps``: the node runs an MPS control daemon for its ``mps`` cards.
    A cache directory where the interposer counts the card's memory and the grant
    carries a memory limit; a namespace where the card's compute is MPS's (without
    namespaces, a device-plugin answer still asks the control daemon, which makes
    nothing; a claim asks nothing). A claim's share of a card whose memory limit is
    the driver's gets a holder directory (one live container per share)."""
    cache_dir = holder = None
    if claim and memory_mib is not None and enforcement.by_driver(uuid):
        holder = dirs.holder(key)
    if memory_mib is not None and enforcement.interposer_counts_memory(uuid):
        cache_dir = dirs.cache_dir(key)
    need = pipe = None
    namespaces = dirs.mps_namespaces
    if mps and enforcement.by_mps(uuid) and (not claim or namespaces is not None):
        pinned = enforcement.memory_soft(uuid)
        other = tuple(partner) if partner is not None else None
        need = MpsNeed(memory_mib, cores, pinned, other, claim)
        if namespaces is not None and memory_mib is not None:
            pipe = namespaces / key
    return HostNeeds(key, tuple(units), cache_dir, keep, need, pipe, holder)


def needs_record(needs: HostNeeds) -> dict[str, Any]:
    """A claim share's host side as its checkpoint entry keeps it (plain JSON): what
    :meth:`GrantHost.make` made, so that it can be made again where a reboot emptied
    the tmpfs it lived on (``dra/rebuild.py``)."""
    mps = needs.mps
    return {
        "key": needs.key,
        "cache_dir": str(needs.cache_dir) if needs.cache_dir is not None else None,
        "holder": str(needs.holder) if needs.holder is not None else None,
        "mps_pipe": str(needs.mps_pipe) if needs.mps_pipe is not None else None,
        "mps": [mps.memory_mib, mps.cores, mps.pinned] if mps is not None else None,
    }


def needs_from_record(record: Any, dirs: NodeDirs) -> HostNeeds:
    """The claim share's host side a :func:`needs_record` names, to be made again where
    it is missing (``keep``: a directory still there is left as it is). ValueError when
    the record is not one, or names a directory other than where ``dirs`` puts its key
    (another ``--host-lib-dir``, or a record not written by this daemon): nothing is
    made outside the node's own directories. Pure."""
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        raise ValueError("a host record without a key")
    key = record["key"]
    expected = {
        "cache_dir": dirs.cache_dir(key),
        "holder": dirs.holder(key),
        "mps_pipe": dirs.mps_namespaces / key if dirs.mps_namespaces is not None else None,
    }
    paths: dict[str, Path | None] = {}
    for name, where in expected.items():
        given = record.get(name)
        if given is not None and (where is None or Path(str(given)) != where):
            raise ValueError(f"the {name} of {key} ({given}) is not where this node keeps it")
        paths[name] = where if given is not None else None
    mps = record.get("mps")
    need = None
    if mps is not None:
        memory, cores, pinned = _mps_fields(mps)
        need = MpsNeed(memory, cores, pinned, claim=True)
    return HostNeeds(
        key,
        cache_dir=paths["cache_dir"],
        keep=True,
        mps=need,
        mps_pipe=paths["mps_pipe"],
        holder=paths["holder"],
    )


def _mps_fields(value: Any) -> tuple[int | None, int | None, bool]:
    if not isinstance(value, list) or len(value) != 3 or not isinstance(value[2], bool):
        raise ValueError(f"{str(value)[:80]} is not an MPS record")
    memory, cores = value[0], value[1]
    for count in (memory, cores):
        if count is not None and (type(count) is not int or count < 0):
            raise ValueError(f"{str(value)[:80]} is not an MPS record")
    return memory, cores, value[2]


def with_dirs(grant: answers.Grant, needs: HostNeeds) -> answers.Grant:
    """``grant`` naming the directories ``needs`` says the container gets."""
    return replace(grant, cache_dir=needs.cache_dir, mps_pipe=needs.mps_pipe, holder=needs.holder)


class GrantHost:
    """Makes, seals and undoes grants' host sides on this node (every door's)."""

    def __init__(
        self,
        dirs: NodeDirs,
        *,
        mps: MpsGrants | None = None,
        specs: GrantSpecs | None = None,
        listing: DeviceListing | None = None,
    ) -> None:
        self.dirs = dirs
        self.mps = mps
        self.specs = specs  # the device plugin's grant specs (a CDI strategy only)
        self.listing = listing

    @classmethod
    def of(
        cls,
        lib_dir: Path,
        *,
        mps: MpsGrants | None = None,
        specs: GrantSpecs | None = None,
        listing: DeviceListing | None = None,
    ) -> GrantHost:
        """The host side of a node whose MPS daemon (if any) is ``mps``."""
        host = cls(NodeDirs(lib_dir), mps=mps, specs=specs, listing=listing)
        host.plan_dirs()
        return host

    def plan_dirs(self) -> NodeDirs:
        """The node's directories as :func:`share_needs` reads them, now (the MPS
        control daemon learns whether it has namespaces when it starts)."""
        mps = self.mps
        root = mps.control.pipe_dir / SERVER if mps is not None and mps.namespaces else None
        if root != self.dirs.mps_namespaces:
            self.dirs = replace(self.dirs, mps_namespaces=root)
        return self.dirs

    # ------------------------------------------------------------------ make
    def make(self, needs: HostNeeds) -> None:
        """Make what ``needs`` says, where it says (HostGrantError if it cannot be)."""
        if needs.cache_dir is not None and not (needs.keep and _kept(needs.cache_dir)):
            try:
                if needs.units:
                    prepare_cache_dir(self.dirs.lib_dir, list(needs.units))
                else:
                    prepare_claim_cache_dir(self.dirs.lib_dir, needs.key)
            except OSError as exc:
                raise HostGrantError(
                    f"cannot create the container's cache directory: {exc}"
                ) from None
        if needs.holder is not None:
            try:
                make_holder_dir(needs.holder)
            except OSError as exc:
                raise HostGrantError(f"cannot create the claim's holder directory: {exc}") from None
        if needs.mps is not None and self.mps is not None:
            try:
                pipe = self._namespace(needs, needs.mps, self.mps)
            except (MpsError, OSError) as exc:
                raise HostGrantError(f"cannot cap the container's MPS namespace: {exc}") from None
            if pipe != needs.mps_pipe:
                raise HostGrantError(
                    "cannot cap the container's MPS namespace: the control daemon's "
                    f"namespaces changed (pipe directory {pipe}, not {needs.mps_pipe})"
                )

    def _namespace(self, needs: HostNeeds, need: MpsNeed, mps: MpsGrants) -> Path | None:
        if need.claim:
            marker = prepare_claim_cache_dir(self.dirs.lib_dir, needs.key)  # never mounted
            memory = need.memory_mib or 0
            return mps.claim(needs.key, marker, memory, need.cores or 0, pinned=need.pinned)
        units = list(needs.units)
        if need.memory_mib is not None:
            return mps.memory(
                units, need.memory_mib, pinned=need.pinned, partner_cores=need.partner
            )
        mps.cores(units, need.cores or 0, partner_memory=need.partner)
        return None

    # ------------------------------------------------------------------ specs
    @property
    def seals(self) -> bool:
        """Device-plugin grants ride on a CDI spec of their own (a CDI strategy)."""
        return self.specs is not None and self.listing is not None and self.listing.uses_cdi

    def seal(self, edits: ContainerEdits, name: str) -> ContainerEdits:
        """A device-plugin grant's answer: ``edits`` as they are, or, under a CDI strategy,
        written to the grant's own CDI spec ``name`` and the answer naming it. The device
        nodes stay in the kubelet's answer (the kubelet passes them), not in the spec."""
        specs, listing = self.specs, self.listing
        if specs is None or listing is None or not listing.uses_cdi:
            return edits
        try:
            cdi_name = specs.write(name, replace(edits, device_specs=[]))
        except OSError as exc:
            raise HostGrantError(
                f"cannot write the grant's CDI spec in {specs.directory}: {exc}"
            ) from None
        return answers.sealed(edits, cdi_name, listing)

    def write_claim_spec(
        self, cdi_dir: Path, kind: str, uid: str, devices: Sequence[CdiDevice]
    ) -> None:
        """A DRA claim's CDI spec: one CDI device per result (HostGrantError if it cannot
        be written)."""
        try:
            write_spec(cdi_dir, kind, uid, devices)
        except OSError as exc:
            raise HostGrantError(f"cannot write the claim's CDI spec in {cdi_dir}: {exc}") from None

    def write_claim_document(
        self, cdi_dir: Path, kind: str, uid: str, document: Mapping[str, object]
    ) -> None:
        """A DRA claim's CDI spec from its document (:func:`~gpushare.host.cdi.spec_json`,
        as the claim's checkpoint entry keeps it): the bytes a first write and a rebuild
        write are the same (HostGrantError if it cannot be written)."""
        try:
            write_spec_document(cdi_dir, kind, uid, document)
        except (OSError, ValueError) as exc:
            raise HostGrantError(f"cannot write the claim's CDI spec in {cdi_dir}: {exc}") from None

    # ------------------------------------------------------------------ undo
    def release(self, keys: Iterable[str]) -> None:
        """Undo the directories of a claim's grants (buried: the reaper deletes them;
        their MPS namespaces go with their marker, ``MpsGrants.collect``; their holder
        directories removed). OSError or ValueError for a key that cannot be released
        (unprepare reports it)."""
        for key in keys:
            release_cache_dir(self.dirs.lib_dir, key)
            release_holder_dir(self.dirs.holder(key))


def _kept(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()
