"""Prepare and unprepare ResourceClaims: the work behind NodePrepareResources.

The kubelet sends only a claim's namespace, name and UID. For each claim this reads
the claim from the API server, refuses it unless it is allocated and has that UID,
takes the results of this driver on this node's pool, and for each one builds the
container's edits with the answer port every door calls
(:func:`~gpushare.share.answers.container_edits`: for a share of a card HAMi-core's
limits from the rounded ``consumedCapacity``, the preload, the lock directory and a
fresh cache directory; for a MIG device the raw device), then writes one CDI spec per
claim holding one CDI device per result and answers the CDI names. Every share result
of a claim sets the same limits for every index: the smallest shares of the claim and
of every claim it shares a container with (:mod:`gpushare.dra.mates`, read from the
pods the claim is reserved for); a claim is refused while one it shares a container
with is prepared with more than the smallest share there. The API reads of a call are
in :mod:`gpushare.dra.claimread`. Each claim is
recorded in the checkpoint once all of it is made, under the node lock; a claim
already prepared is answered from the checkpoint, and unpreparing one that is not
there succeeds.

Nothing the caller sends is trusted: the namespace and name must be DNS names (they
become a URL), the UID must be the claim's, and a result naming a device that is not
one of this node's, or a capacity no card holds, fails that claim alone, with one line.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gpushare.dra.checkpoint import (
    PREPARED,
    RECOVERED,
    Checkpoint,
    CheckpointError,
    ClaimEntry,
    LockTimeout,
    NodeLock,
    PreparedDevice,
)
from gpushare.dra.claimread import (
    ClaimLimits,
    ClaimRef,
    ClaimRefused,
    ClaimSource,
    check_ref,
    claim_limits,
    read_pending,
)
from gpushare.dra.held import HeldClaims
from gpushare.dra.mates import (
    Shares,
    Together,
    applied_limits,
    overreaching,
    promised,
    smallest,
)
from gpushare.dra.model import (
    FULL_CORES,
    Offered,
    ShareError,
    share_of,
    unhealthy_reason,
)
from gpushare.dra.recovery import Leftovers, remove_spec_file
from gpushare.gpu.health import HealthBoard
from gpushare.host.cdi import CdiDevice, claim_device, write_spec
from gpushare.host.library import (
    cache_root,
    claim_cache_key,
    prepare_claim_cache_dir,
    release_cache_dir,
)
from gpushare.host.mps import MpsError, MpsGrants
from gpushare.kube.stdlibclient import ApiClient
from gpushare.share import answers
from gpushare.share.answers import Answer, DeviceListing, Enforcement, GrantedDevice

log = structlog.get_logger(__name__)

_NOT_CDI = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Outcome:
    """What one claim's preparation answers: its devices, or why it failed."""

    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


def _held_device(
    request: str, pool: str, device: Offered, cdi_ids: list[str], memory_mib: int, cores: int
) -> PreparedDevice:
    """The record of one prepared device: its answer, and what it holds."""
    return PreparedDevice(
        request,
        pool,
        device.name,
        cdi_ids,
        card=device.card_uuid or device.uuid,
        mig="" if device.shared else device.uuid,
        memory_mib=memory_mib,
        cores=cores,
    )


def _refused(claim: ClaimRef, exc: Exception) -> Outcome:
    log.warning("claim_refused", claim=claim.describe(), uid=claim.uid, reason=str(exc))
    return Outcome(error=str(exc))


def _failed(claim: ClaimRef, exc: Exception) -> Outcome:
    log.error("claim_prepare_failed", claim=claim.describe(), error=str(exc))
    return Outcome(error=f"cannot prepare the claim: {exc}")


def _unfinished(
    claims: Sequence[ClaimRef], outcomes: dict[str, Outcome], why: str
) -> dict[str, Outcome]:
    """Every claim without an outcome gets ``why`` (the kubelet retries it)."""
    for claim in claims:
        if claim.uid not in outcomes:
            log.warning("claim_prepare_abandoned", claim=claim.describe(), reason=why)
            outcomes[claim.uid] = Outcome(error=f"not prepared: {why}")
    return outcomes


def needs_dir(enforcement: Enforcement, mps: MpsGrants | None, uuid: str) -> bool:
    """A share of card ``uuid`` gets a directory of its own: HAMi-core's cache, or its
    own MPS namespace's pipes (a card whose compute is MPS's, on a driver with them)."""
    if enforcement.interposer_counts_memory(uuid):
        return True
    return mps is not None and enforcement.by_mps(uuid) and mps.namespaces


def _applied(leftovers: Leftovers, uid: str) -> Shares | None:
    """What the spec of claim ``uid`` sets, when it is prepared here (lock held)."""
    entry = leftovers.entry(uid)
    if entry is None or entry.state not in (PREPARED, RECOVERED):
        return None
    return applied_limits(entry, FULL_CORES)


def _shown(
    answer: Answer, device: Offered, memory_mib: int, enforcement: Enforcement
) -> dict[str, str]:
    """One share of a prepared claim as ``claim_prepared`` logs it: its limits."""
    driver = f"{memory_mib}m (driver)" if enforcement.by_driver(device.uuid) else ""
    return {
        "device": device.name,
        "memory": answer.envs.get(answers.MEMORY_LIMIT, "") or driver,
        "cores": answer.envs.get(answers.CORE_LIMIT, ""),
    }


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


class ClaimPreparer:
    """Prepares claims of this node's pool from the checkpoint and the API server."""

    def __init__(
        self,
        *,
        api: ApiClient,
        driver: str,
        pool: str,
        devices: Callable[[], Mapping[str, Offered]],
        health: HealthBoard,
        enforcement: Enforcement,
        listing: DeviceListing,
        unit_mib: int,
        host_lib_dir: Path,
        cdi_dir: Path,
        state_dir: Path,
        api_timeout: float = 5.0,
        mps: MpsGrants | None = None,
    ) -> None:
        self.api = api
        self.driver = driver
        self.pool = pool
        self.devices = devices
        self.health = health
        self.enforcement = enforcement
        self.listing = listing
        self.unit_mib = unit_mib
        self.host_lib_dir = host_lib_dir
        self.cdi_dir = cdi_dir
        self.cdi_kind = f"{driver}/claim"
        self.checkpoint = Checkpoint(state_dir / "claims")
        self.lock = NodeLock(state_dir / "prepare.lock")
        self.leftovers = Leftovers(
            self.checkpoint,
            cdi_dir=cdi_dir,
            cdi_kind=self.cdi_kind,
            host_lib_dir=host_lib_dir,
            pool=pool,
            device_names=lambda: list(self.devices()),
        )
        self.api_timeout = api_timeout
        self.mps = mps  # each claim's MPS namespace on cards whose compute is MPS's
        #: The checkpoint's entries, read by :meth:`tidy` and kept in step: what
        #: readers of the node's state see, without file I/O or the node lock.
        self.held = HeldClaims()

    # ------------------------------------------------------------------ prepare
    def prepare(
        self,
        claims: Sequence[ClaimRef],
        deadline: float | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> dict[str, Outcome]:
        """Every claim's outcome, keyed by the UID the kubelet sent.

        The node lock is held only around the checkpoint and the files, never across
        the API server's answers: the claims are read between two short holds, so a
        slow or hung API server delays this call's claims alone, never an unprepare.
        ``deadline`` (``time.monotonic()``) and ``cancelled`` are the kubelet's call's:
        past the one or once the other says so, what is not done yet is not started."""
        outcomes: dict[str, Outcome] = {}
        changed = False
        pending: list[ClaimRef] = []
        try:
            with self.lock.held(deadline):
                for claim in claims:
                    try:
                        done = self._from_checkpoint(claim)
                    except ClaimRefused as exc:
                        outcomes[claim.uid] = _refused(claim, exc)
                    except (OSError, CheckpointError) as exc:
                        outcomes[claim.uid] = _failed(claim, exc)
                    else:
                        if done is None:
                            pending.append(claim)
                        else:
                            outcomes[claim.uid] = Outcome(devices=done[0])
                            changed |= done[1]
        except LockTimeout as exc:
            return _unfinished(claims, outcomes, str(exc))
        source = ClaimSource(self.api, self.driver, self.pool, self.unit_mib, self.api_timeout)
        read, refused = read_pending(source, pending, self.devices(), deadline, cancelled)
        for claim, why in refused:
            outcomes[claim.uid] = _refused(claim, why)
        try:
            with self.lock.held(deadline) if read else contextlib.nullcontext():
                for claim in pending:
                    if claim.uid not in read or cancelled():
                        continue
                    try:
                        devices, fresh = self._prepare_one(claim, *read[claim.uid])
                    except ClaimRefused as exc:
                        outcomes[claim.uid] = _refused(claim, exc)
                    except (OSError, CheckpointError) as exc:
                        outcomes[claim.uid] = _failed(claim, exc)
                    else:
                        outcomes[claim.uid] = Outcome(devices=devices)
                        changed |= fresh
        except LockTimeout as exc:
            _unfinished(claims, outcomes, str(exc))
        if changed:
            self.held.changed()
        return _unfinished(claims, outcomes, "the kubelet's call ended first")

    def _from_checkpoint(self, claim: ClaimRef) -> tuple[list[PreparedDevice], bool] | None:
        """A prepared claim's devices from its entry (and whether the view changed), or None."""
        check_ref(claim)
        known = self._known(claim)
        if known is not None and known.state == PREPARED:
            # idempotent: the same answer again (maybe prepared by another instance)
            return known.devices, self.held.remember(claim.uid, known)
        return None

    def _known(self, claim: ClaimRef) -> ClaimEntry | None:
        known = self.leftovers.entry(claim.uid)
        if (
            known is not None
            and known.state == PREPARED
            and (known.namespace, known.name) != (claim.namespace, claim.name)
        ):
            raise ClaimRefused(
                f"UID {claim.uid} was prepared as {known.namespace}/{known.name}, "
                f"not {claim.describe()}"
            )
        return known

    def _prepare_one(
        self, claim: ClaimRef, results: list[dict[str, Any]], together: Together
    ) -> tuple[list[PreparedDevice], bool]:
        """The claim's devices, and whether the view of what is held changed (lock held;
        ``results``: this driver's, read from the API server; ``together``: its mates)."""
        known = self._known(claim)  # again: another call may have prepared it meanwhile
        if known is not None and known.state == PREPARED:
            return known.devices, self.held.remember(claim.uid, known)
        # A recovered claim's cache directories may be in use by its running container:
        # kept, never buried (its UID was just confirmed by the API server).
        keep = set(known.cache_keys) if known is not None and known.state == RECOVERED else set()
        offered = self.devices()
        plan = []
        for result in results:
            device = offered.get(str(result.get("device")))
            if device is None:
                raise ClaimRefused(
                    f"claim {claim.describe()}: device {result.get('device')!r} "
                    "is not one of this node's"
                )
            reason = unhealthy_reason(self.health, device)
            if reason is not None:
                raise ClaimRefused(
                    f"claim {claim.describe()}: device {device.name} is unhealthy ({reason})"
                )
            request = str(result.get("request") or "")
            plan.append((request, device, result))
        _needs_no_missing_check(self.enforcement, claim, [d for _, d, _ in plan])
        keys = [
            claim_cache_key(claim.uid, request, device.name)
            for request, device, _ in plan
            if device.shared and needs_dir(self.enforcement, self.mps, device.uuid)
        ]

        cdi_devices: list[CdiDevice] = []
        prepared: list[PreparedDevice] = []
        shares = []
        hold = smallest([together.hold(), promised(self.held.entries(), claim.uid)])
        limits = claim_limits(claim, plan, self.unit_mib, hold)
        if limits.memory_mib is not None:
            why = overreaching(together, claim.uid, lambda uid: _applied(self.leftovers, uid))
            if why:
                raise ClaimRefused(f"claim {claim.describe()}: {why}")
        for request, device, result in plan:
            answer, memory_mib, cores = self._answer(claim, request, device, result, keep, limits)
            cdi_name = f"{claim.uid}-{_NOT_CDI.sub('_', request)}-{device.name}"
            cdi_devices.append(claim_device(cdi_name, answer))
            ids = [f"{self.cdi_kind}={cdi_name}", *answer.cdi_devices]
            prepared.append(_held_device(request, self.pool, device, ids, memory_mib, cores))
            shares.append(_shown(answer, device, memory_mib, self.enforcement))
        if cdi_devices:
            write_spec(self.cdi_dir, self.cdi_kind, claim.uid, cdi_devices)
        entry = ClaimEntry(
            claim.namespace,
            claim.name,
            PREPARED,
            spec_name=claim.uid,
            cache_keys=keys,
            devices=prepared,
            memory_limit_mib=limits.memory_mib,
            core_limit=None if limits.memory_mib is None else limits.cores or FULL_CORES,
            held_with=together.floors(claim.uid),
        )
        self.checkpoint.put(claim.uid, entry)
        self.held.remember(claim.uid, entry)
        log.info("claim_prepared", claim=claim.describe(), uid=claim.uid, shares=shares)
        return prepared, True

    def _answer(
        self,
        claim: ClaimRef,
        request: str,
        device: Offered,
        result: Mapping[str, Any],
        keep: set[str],
        limits: ClaimLimits,
    ) -> tuple[Answer, int, int]:
        """The answer (enforcing ``limits``), the memory it holds (MiB) and its cores (0: none)."""
        if not device.shared:
            grant = answers.whole([GrantedDevice(device.uuid, memory_mib=device.memory_mib)])
            return answers.container_edits(grant, self.listing), device.memory_mib, 0
        try:
            share = share_of(result.get("consumedCapacity"), device.card_memory_mib, self.unit_mib)
        except ShareError as exc:
            raise ClaimRefused(f"claim {claim.describe()}, device {device.name}: {exc}") from None
        cache_dir = mps_pipe = None
        key = claim_cache_key(claim.uid, request, device.name)
        memory_mib = limits.memory_mib or share.memory_mib
        if self.enforcement.interposer_counts_memory(device.uuid):
            kept = cache_root(self.host_lib_dir) / key
            if key in keep and kept.is_dir() and not kept.is_symlink():
                cache_dir = kept
            else:
                cache_dir = prepare_claim_cache_dir(self.host_lib_dir, key)
        elif needs_dir(self.enforcement, self.mps, device.uuid) and self.mps is not None:
            marker = prepare_claim_cache_dir(self.host_lib_dir, key)  # never mounted
            soft = self.enforcement.memory_soft(device.uuid)
            try:
                mps_pipe = self.mps.claim(key, marker, memory_mib, limits.cores or 0, pinned=soft)
            except MpsError as exc:
                raise ClaimRefused(f"claim {claim.describe()}: MPS namespace: {exc}") from None
        grant = answers.share(
            device.uuid,
            enforcement=self.enforcement,
            memory_mib=limits.memory_mib,
            cores=limits.cores,  # None: no cores asked, unthrottled as memory-only
            cache_dir=cache_dir,
            every_index=True,
            companions=limits.cards,
            mps_pipe=mps_pipe,
            charged=limits.charged,
        )
        answer = answers.container_edits(grant, self.listing)
        return answer, share.memory_mib, share.cores

    # ------------------------------------------------------------------ unprepare
    def unprepare(
        self, claims: Sequence[ClaimRef], deadline: float | None = None
    ) -> dict[str, str]:
        """Every claim's error ("" when done). A claim with no entry is done once what
        its CDI spec names (if any is left) is gone; an unreadable entry is recovered
        from that spec first. Needs no API server."""
        errors: dict[str, str] = {}
        changed = False
        try:
            with self.lock.held(deadline):
                for claim in claims:
                    try:
                        entry = self.leftovers.entry(claim.uid)
                        if entry is None:
                            self.leftovers.release_unknown(claim.uid)
                        else:
                            self._release(entry)
                            self.checkpoint.delete(claim.uid)
                    except (OSError, ValueError, CheckpointError) as exc:
                        log.error("claim_unprepare_failed", uid=claim.uid, error=str(exc))
                        errors[claim.uid] = f"cannot unprepare the claim: {exc}"
                        continue
                    changed |= self.held.remember(claim.uid, None)
                    if entry is not None:
                        log.info(
                            "claim_unprepared",
                            claim=f"{entry.namespace}/{entry.name}",
                            uid=claim.uid,
                        )
                    errors[claim.uid] = ""
        except LockTimeout as exc:
            for claim in claims:
                errors.setdefault(claim.uid, f"not unprepared: {exc}")
        if changed:
            self.held.changed()
        return errors

    def _release(self, entry: ClaimEntry) -> None:
        remove_spec_file(self.leftovers.spec_path(entry.spec_name))
        for key in entry.cache_keys:
            release_cache_dir(self.host_lib_dir, key)

    # ------------------------------------------------------------------ start
    def tidy(self) -> None:
        """At start: read what is held into the view (:attr:`held`), recover the entries
        of claims whose CDI spec outlived their entry, remove claim cache directories
        that nothing names (see :mod:`gpushare.dra.recovery`). Never fails the start:
        what cannot be sorted out is logged and left."""
        with self.lock.held():
            self.held.replace_all(self.leftovers.tidy())
