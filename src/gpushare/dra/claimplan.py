"""One claim's preparation, decided: what to refuse and what to grant. Pure.

:class:`~gpushare.dra.claims.ClaimPreparer` reads the facts (the claim's results from
the API server, the mates it shares containers with, the checkpoint's entries) and
calls :func:`plan_claim`, which touches no file and no clock: it refuses the claim
(:class:`~gpushare.dra.claimread.ClaimRefused`: a device not of this node or
unhealthy, a share no card holds, a mate prepared above the smallest share, a limit
check missing) or says everything its preparation makes (:class:`ClaimPlan`): each
result's grant, its host side (:func:`gpushare.host.grants.share_needs`), its
container edits from the answer port and CDI device, and the checkpoint entry. The
preparer then applies it (the host side made, the spec written, the entry put), the
way kubernetes-sigs/dra-example-driver keeps ``computeDeviceConfig`` apart from
``prepareDevices``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpushare.dra.checkpoint import PREPARED, ClaimEntry, PreparedDevice
from gpushare.dra.claimread import ClaimLimits, ClaimRef, ClaimRefused, claim_limits
from gpushare.dra.mates import Shares, Together, overreaching, promised, smallest
from gpushare.dra.model import FULL_CORES, Offered, ShareError, share_of, unhealthy_reason
from gpushare.gpu.health import HealthReader
from gpushare.host.cdi import CdiDevice, claim_device, spec_json
from gpushare.host.grants import HostNeeds, NodeDirs, needs_record, share_needs, with_dirs
from gpushare.host.library import claim_cache_key
from gpushare.share import answers
from gpushare.share.answers import ContainerEdits, DeviceListing, Enforcement, GrantedDevice

_NOT_CDI = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class ClaimNode:
    """What the node gives every claim: its devices, their health and enforcement, how
    answers name devices, the unit size and the directories the host side lives in."""

    pool: str
    cdi_kind: str  # ``<driver>/claim``
    devices: Mapping[str, Offered]
    health: HealthReader
    enforcement: Enforcement
    listing: DeviceListing
    unit_mib: int
    dirs: NodeDirs
    mps: bool = False  # the node runs an MPS control daemon for its ``mps`` cards
    #: MIG UUID -> its device nodes (``--mig-device-specs``; empty: none passed)
    mig_nodes: Mapping[str, Sequence[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class PlannedResult:
    """One result of the claim, planned: its edits, its host side and its record."""

    edits: ContainerEdits
    needs: HostNeeds | None  # None: nothing on the host (a whole MIG device)
    cdi: CdiDevice  # the claim's CDI device carrying ``edits``
    record: PreparedDevice  # as the checkpoint keeps it
    shown: dict[str, str]  # as ``claim_prepared`` logs it


@dataclass(frozen=True)
class ClaimPlan:
    """Everything one claim's preparation makes, before anything is made."""

    results: list[PlannedResult]
    entry: ClaimEntry

    @property
    def devices(self) -> list[PreparedDevice]:
        return [r.record for r in self.results]


def plan_claim(
    claim: ClaimRef,
    results: Sequence[Mapping[str, Any]],
    together: Together,
    node: ClaimNode,
    *,
    held: Iterable[ClaimEntry],
    applied: Callable[[str], Shares | None],
    keep: Iterable[str] = (),
) -> ClaimPlan:
    """The plan of ``claim`` (``results``: this driver's, read from the API server;
    ``together``: its mates; ``held``: the entries of the claims prepared here;
    ``applied``: what a prepared claim's spec sets; ``keep``: a recovered claim's cache
    keys, whose directories its running container may use). ClaimRefused if refused."""
    chosen = _chosen(claim, results, node)
    _needs_no_missing_check(node.enforcement, claim, [d for _, d, _ in chosen])
    # First the claim among its mates (what they hold it to, what it must not exceed
    # for them, what they must not exceed for it), then its results one by one.
    hold = smallest([together.hold(), promised(held, claim.uid)])
    limits = claim_limits(claim, chosen, node.unit_mib, hold)
    if limits.memory_mib is not None:
        why = overreaching(together, claim.uid, applied)
        if why:
            raise ClaimRefused(f"claim {claim.describe()}: {why}")
    floors = together.floors(claim.uid)
    kept = set(keep)
    planned = [_result(claim, r, d, res, limits, node, kept) for r, d, res in chosen]
    entry = ClaimEntry(
        claim.namespace,
        claim.name,
        PREPARED,
        spec_name=claim.uid,
        cache_keys=[k for p in planned if p.needs is not None for k in p.needs.made_keys],
        devices=[p.record for p in planned],
        memory_limit_mib=limits.memory_mib,
        core_limit=None if limits.memory_mib is None else limits.cores or FULL_CORES,
        held_with=floors,
        spec=spec_json(node.cdi_kind, [p.cdi for p in planned]) if planned else None,
        made=[needs_record(n) for n in (p.needs for p in planned) if n and not n.nothing],
    )
    return ClaimPlan(planned, entry)


def _chosen(
    claim: ClaimRef, results: Sequence[Mapping[str, Any]], node: ClaimNode
) -> list[tuple[str, Offered, Mapping[str, Any]]]:
    """(request, device, result) of every result: a device of this node, healthy."""
    chosen = []
    for result in results:
        device = node.devices.get(str(result.get("device")))
        if device is None:
            raise ClaimRefused(
                f"claim {claim.describe()}: device {result.get('device')!r} "
                "is not one of this node's"
            )
        reason = unhealthy_reason(node.health, device)
        if reason is not None:
            raise ClaimRefused(
                f"claim {claim.describe()}: device {device.name} is unhealthy ({reason})"
            )
        chosen.append((str(result.get("request") or ""), device, result))
    return chosen


def _needs_no_missing_check(
    enforcement: Enforcement, claim: ClaimRef, devices: Sequence[Offered]
) -> None:
    """Refuses the claim (before anything is made for it) when a share of it would name
    the limit check and the check is not installed (``node/enforcement.py``)."""
    if enforcement.limit_check is None and any(
        d.shared and enforcement.interposer_holds_a_limit(d.uuid) for d in devices
    ):
        raise ClaimRefused(
            f"claim {claim.describe()}: the limit check (the memory hook, --memory-hook) "
            "is not installed on this node, and a share's limit could not be held against "
            "a larger one in its container (the daemon logged limit_check_unavailable)"
        )


def _result(
    claim: ClaimRef,
    request: str,
    device: Offered,
    result: Mapping[str, Any],
    limits: ClaimLimits,
    node: ClaimNode,
    keep: set[str],
) -> PlannedResult:
    """One result planned: its grant's edits (enforcing ``limits``), host side, CDI
    device and record (the memory it holds and its cores, 0: none)."""
    needs = None
    if not device.shared:
        nodes = tuple(node.mig_nodes.get(device.uuid, ()))
        granted = GrantedDevice(device.uuid, memory_mib=device.memory_mib, nodes=nodes)
        edits = answers.container_edits(answers.whole([granted]), node.listing)
        memory_mib, cores = device.memory_mib, 0
    else:
        edits, needs, memory_mib, cores = _share(claim, request, device, result, limits, node, keep)
    cdi_name = f"{claim.uid}-{_NOT_CDI.sub('_', request)}-{device.name}"
    ids = [f"{node.cdi_kind}={cdi_name}", *edits.cdi_devices]
    record = PreparedDevice(
        request,
        node.pool,
        device.name,
        ids,
        card=device.card_uuid or device.uuid,
        mig="" if device.shared else device.uuid,
        memory_mib=memory_mib,
        cores=cores,
    )
    shown = _shown(edits, device, memory_mib, node.enforcement)
    return PlannedResult(edits, needs, claim_device(cdi_name, edits), record, shown)


def _share(
    claim: ClaimRef,
    request: str,
    device: Offered,
    result: Mapping[str, Any],
    limits: ClaimLimits,
    node: ClaimNode,
    keep: set[str],
) -> tuple[ContainerEdits, HostNeeds, int, int]:
    """A share of a card: its edits, its host side, and the memory and cores it was
    granted (its ``consumedCapacity``; the edits enforce ``limits``, which may be less)."""
    try:
        share = share_of(result.get("consumedCapacity"), device.card_memory_mib, node.unit_mib)
    except ShareError as exc:
        raise ClaimRefused(f"claim {claim.describe()}, device {device.name}: {exc}") from None
    key = claim_cache_key(claim.uid, request, device.name)
    needs = share_needs(
        node.enforcement,
        device.uuid,
        node.dirs,
        key=key,
        memory_mib=limits.memory_mib or share.memory_mib,
        cores=limits.cores,
        mps=node.mps,
        claim=True,
        keep=key in keep,
    )
    grant = answers.share(
        device.uuid,
        enforcement=node.enforcement,
        memory_mib=limits.memory_mib,
        cores=limits.cores,  # None: no cores asked, unthrottled as memory-only
        every_index=True,
        companions=limits.cards,
        charged=limits.charged,
    )
    edits = answers.container_edits(with_dirs(grant, needs), node.listing)
    return edits, needs, share.memory_mib, share.cores


def _shown(
    edits: ContainerEdits, device: Offered, memory_mib: int, enforcement: Enforcement
) -> dict[str, str]:
    """One share of a prepared claim as ``claim_prepared`` logs it: its limits."""
    driver = f"{memory_mib}m (driver)" if enforcement.by_driver(device.uuid) else ""
    return {
        "device": device.name,
        "memory": edits.envs.get(answers.MEMORY_LIMIT, "") or driver,
        "cores": edits.envs.get(answers.CORE_LIMIT, ""),
    }
