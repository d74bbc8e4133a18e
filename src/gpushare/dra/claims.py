"""Prepare and unprepare ResourceClaims: the work behind NodePrepareResources.

The kubelet sends only a claim's namespace, name and UID. For each claim this reads
the claim from the API server, refuses it unless it is allocated and has that UID,
takes the results of this driver on this node's pool, and plans the claim
(:func:`~gpushare.dra.claimplan.plan_claim`, pure: for each result the container's edits
from the answer port every door calls, :func:`~gpushare.share.answers.container_edits`:
for a share of a card HAMi-core's limits from the rounded ``consumedCapacity``, the
preload, the lock directory and a fresh cache directory; for a MIG device the raw
device and, with ``--mig-device-specs``, its device nodes), then applies the plan: the
host side made by :class:`~gpushare.host.grants.GrantHost`, one CDI spec per claim
holding one CDI device per result, and answers the CDI names. Every share result
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
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
from gpushare.dra.claimplan import ClaimNode, ClaimPlan, plan_claim
from gpushare.dra.claimread import (
    ClaimRef,
    ClaimRefused,
    ClaimSource,
    check_ref,
    read_pending,
)
from gpushare.dra.held import HeldClaims
from gpushare.dra.mates import Shares, Together, applied_limits
from gpushare.dra.model import FULL_CORES, Offered
from gpushare.dra.rebuild import apply_rebuild, host_found, plan_rebuild
from gpushare.dra.recovery import Leftovers, remove_spec_file
from gpushare.gpu.health import HealthBoard
from gpushare.host.grants import GrantHost, HostGrantError
from gpushare.host.mps import MpsGrants
from gpushare.kube.stdlibclient import ApiClient
from gpushare.share.answers import DeviceListing, Enforcement

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What one claim's preparation answers: its devices, or why it failed."""

    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


def _refused(claim: ClaimRef, exc: Exception) -> Outcome:
    log.warning("claim_refused", claim=claim.describe(), uid=claim.uid, reason=str(exc))
    return Outcome(error=str(exc))


def _failed(claim: ClaimRef, exc: Exception) -> Outcome:
    log.error("claim_prepare_failed", claim=claim.describe(), error=str(exc))
    return Outcome(error=f"cannot prepare the claim: {exc}")


def _attempt(
    claim: ClaimRef, step: Callable[[], tuple[list[PreparedDevice], bool] | None]
) -> tuple[Outcome | None, bool]:
    """One step of a claim's preparation: its outcome (None: the step left it to the
    next one) and whether the view of what is held changed; a refusal or a failure is
    the claim's outcome, with one line."""
    try:
        done = step()
    except ClaimRefused as exc:
        return _refused(claim, exc), False
    except (OSError, CheckpointError, HostGrantError) as exc:
        return _failed(claim, exc), False
    if done is None:
        return None, False
    return Outcome(devices=done[0]), done[1]


def _unfinished(
    claims: Sequence[ClaimRef], outcomes: dict[str, Outcome], why: str
) -> dict[str, Outcome]:
    """Every claim without an outcome gets ``why`` (the kubelet retries it)."""
    for claim in claims:
        if claim.uid not in outcomes:
            log.warning("claim_prepare_abandoned", claim=claim.describe(), reason=why)
            outcomes[claim.uid] = Outcome(error=f"not prepared: {why}")
    return outcomes


def _applied(leftovers: Leftovers, uid: str) -> Shares | None:
    """What the spec of claim ``uid`` sets, when it is prepared here (lock held)."""
    entry = leftovers.entry(uid)
    if entry is None or entry.state not in (PREPARED, RECOVERED):
        return None
    return applied_limits(entry, FULL_CORES)


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
        mig_nodes: Mapping[str, Sequence[str]] | None = None,
        watched_pod: Callable[[str], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self.api = api
        #: this node's pods by UID as the pod watch holds them: the reserving pods found
        #: there are not read again (:mod:`gpushare.dra.mates`)
        self.watched_pod = watched_pod
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
        #: the claims' host side: cache directories, each claim's MPS namespace on cards
        #: whose compute is MPS's (the claim's CDI spec is written into ``cdi_dir``)
        self.host = GrantHost.of(host_lib_dir, mps=mps)
        #: MIG UUID -> its device nodes (``--mig-device-specs``), as the MIG door passes
        self.mig_nodes = dict(mig_nodes or {})
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
                    outcome, fresh = _attempt(claim, partial(self._from_checkpoint, claim))
                    if outcome is None:
                        pending.append(claim)
                    else:
                        outcomes[claim.uid], changed = outcome, changed or fresh
        except LockTimeout as exc:
            return _unfinished(claims, outcomes, str(exc))
        source = ClaimSource(
            self.api, self.driver, self.pool, self.unit_mib, self.api_timeout, self.watched_pod
        )
        read, refused = read_pending(source, pending, self.devices(), deadline, cancelled)
        for claim, why in refused:
            outcomes[claim.uid] = _refused(claim, why)
        try:
            with self.lock.held(deadline) if read else contextlib.nullcontext():
                for claim in pending:
                    if claim.uid not in read or cancelled():
                        continue
                    step = partial(self._prepare_one, claim, *read[claim.uid])
                    outcome, fresh = _attempt(claim, step)
                    assert outcome is not None  # prepared, refused or failed
                    outcomes[claim.uid], changed = outcome, changed or fresh
        except LockTimeout as exc:
            _unfinished(claims, outcomes, str(exc))
        if changed:
            self.held.changed()
        return _unfinished(claims, outcomes, "the kubelet's call ended first")

    def _from_checkpoint(self, claim: ClaimRef) -> tuple[list[PreparedDevice], bool] | None:
        """A prepared claim's devices from its entry (and whether the view changed), or None."""
        check_ref(claim)
        known = self._known(claim)
        if known is not None and known.state == PREPARED and self._host_kept(claim, known):
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
        if known is not None and known.state == PREPARED and self._host_kept(claim, known):
            return known.devices, self.held.remember(claim.uid, known)
        # A recovered claim's cache directories may be in use by its running container:
        # kept, never buried (its UID was just confirmed by the API server); so are
        # those of a prepared claim whose entry kept no spec to rebuild it from.
        keep = known.cache_keys if known is not None else ()
        plan = plan_claim(
            claim,
            results,
            together,
            self._node(),
            held=self.held.entries(),
            applied=lambda uid: _applied(self.leftovers, uid),
            keep=keep,
        )
        self._apply(claim, plan, keep, fresh=known is None)
        return plan.devices, True

    def _host_kept(self, claim: ClaimRef, known: ClaimEntry) -> bool:
        """Whether prepared claim ``known``'s host side is there, once what was missing
        is made again from its entry (``dra/rebuild.py``: a reboot empties the CDI
        directory and the cache tmpfs); logged as one ``claim_rebuilt``. False for an
        entry that kept no spec (written before): prepared again from the API server.
        HostGrantError when it cannot be made (lock held)."""
        dirs = self.host.plan_dirs()
        found = host_found(known, self.leftovers.spec_path(known.spec_name), dirs)
        try:
            rebuild = plan_rebuild(known, found, dirs)
        except ValueError as exc:
            raise HostGrantError(f"cannot rebuild the claim's host side: {exc}") from None
        if rebuild is None:
            return True
        if rebuild.replan:
            log.warning(
                "claim_host_side_lost",
                claim=claim.describe(),
                uid=claim.uid,
                lost=list(rebuild.lost),
                then="prepared again from the API server (an entry that kept no spec)",
            )
            return False
        apply_rebuild(self.host, self.cdi_dir, self.cdi_kind, known.spec_name, rebuild)
        log.warning("claim_rebuilt", claim=claim.describe(), uid=claim.uid, lost=list(rebuild.lost))
        return True

    def _node(self) -> ClaimNode:
        """What the node gives every claim now (plain data for :func:`plan_claim`)."""
        return ClaimNode(
            self.pool,
            self.cdi_kind,
            self.devices(),
            self.health,
            self.enforcement,
            self.listing,
            self.unit_mib,
            self.host.plan_dirs(),
            mps=self.host.mps is not None,
            mig_nodes=self.mig_nodes,
        )

    def _apply(self, claim: ClaimRef, plan: ClaimPlan, keep: Sequence[str], *, fresh: bool) -> None:
        """Make the plan's host side, write the claim's CDI spec and put its entry (lock
        held). When a step fails, what this call made is undone: the directories made
        fresh and, for a claim that had no entry (``fresh``: no container can hold its
        spec yet), the spec; a recovered claim's are left to its running container."""
        made: list[str] = []
        written = False
        try:
            for result in plan.results:
                if result.needs is not None:
                    made += [k for k in result.needs.made_keys if k not in keep]
                    self.host.make(result.needs)
            if plan.entry.spec is not None:  # the document a rebuild writes again
                spec = plan.entry.spec
                self.host.write_claim_document(self.cdi_dir, self.cdi_kind, claim.uid, spec)
                written = fresh
            self.checkpoint.put(claim.uid, plan.entry)
        except (HostGrantError, OSError, CheckpointError):
            with contextlib.suppress(OSError, ValueError):
                self.host.release(made)
                if written:
                    remove_spec_file(self.leftovers.spec_path(claim.uid))
            raise
        self.held.remember(claim.uid, plan.entry)
        shares = [r.shown for r in plan.results]
        log.info("claim_prepared", claim=claim.describe(), uid=claim.uid, shares=shares)

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
        self.host.release(entry.cache_keys)

    # ------------------------------------------------------------------ start
    def tidy(self) -> None:
        """At start: read what is held into the view (:attr:`held`), recover the entries
        of claims whose CDI spec outlived their entry, remove claim cache directories
        that nothing names (see :mod:`gpushare.dra.recovery`). Never fails the start:
        what cannot be sorted out is logged and left."""
        with self.lock.held():
            held = self.leftovers.tidy()
            self.held.replace_all(held)
            for uid, entry in held.items():
                if entry.state != PREPARED:
                    continue
                ref = ClaimRef(entry.namespace, entry.name, uid)
                try:
                    self._host_kept(ref, entry)  # the kubelet may never ask (no restart)
                except (HostGrantError, OSError) as exc:
                    log.error("claim_rebuild_failed", claim=ref.describe(), uid=uid, error=str(exc))
