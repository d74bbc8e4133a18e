"""What the API server says about the claims of one prepare call: each claim, checked
(:func:`check_ref`, :func:`results_of`), its own shares on this node
(:func:`claim_shares`), the limits its spec sets (:func:`claim_limits`), and the claims
it shares a container with (:mod:`gpushare.dra.mates`), all read outside the node lock
(:func:`read_pending`)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.dra.mates import MateReader, MatesUnknown, Shares, Together
from gpushare.dra.model import API_VERSION, FULL_CORES, Offered, ShareError, share_of
from gpushare.kube.stdlibclient import ApiClient, ApiStatusError

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")


class ClaimRefused(Exception):
    """This claim cannot be prepared; the message is the one line the kubelet shows."""


def claim_path(namespace: str, name: str) -> str:
    return f"/apis/{API_VERSION}/namespaces/{namespace}/resourceclaims/{name}"


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    def describe(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class ClaimLimits:
    """The limits every share of one claim enforces (:func:`claim_limits`)."""

    memory_mib: int | None = None
    cores: int | None = None
    cards: tuple[str, ...] = ()  # the claim's cards in the node's order, when several
    #: what the claim itself was charged, before ``hold``: its smallest memory share and
    #: core share (None: no core limit asked), the most its limit check lets any card index
    #: of its container have (``share/answers.limit_check``)
    charged: tuple[int, int | None] | None = None


def check_ref(claim: ClaimRef) -> None:
    if not _DNS_SUBDOMAIN.match(claim.namespace) or len(claim.namespace) > 63:
        raise ClaimRefused(f"namespace {claim.namespace[:80]!r} is not a namespace name")
    if not _DNS_SUBDOMAIN.match(claim.name):
        raise ClaimRefused(f"name {claim.name[:80]!r} is not a ResourceClaim name")
    if not _UID.match(claim.uid):
        raise ClaimRefused(f"UID {claim.uid[:80]!r} is not a UID")


def read_claim(api: ApiClient, claim: ClaimRef, timeout: float) -> dict[str, Any]:
    try:
        found = api.get(claim_path(claim.namespace, claim.name), timeout=timeout)
    except ApiStatusError as exc:
        if exc.status == 404:
            raise ClaimRefused(f"claim {claim.describe()} not found") from None
        raise ClaimRefused(f"cannot read claim {claim.describe()}: {exc}") from None
    except OSError as exc:
        raise ClaimRefused(
            f"cannot read claim {claim.describe()}: API server unreachable ({exc})"
        ) from None
    if not isinstance(found, dict):
        raise ClaimRefused(f"claim {claim.describe()}: the API server sent no object")
    return found


def results_of(
    claim: ClaimRef, found: dict[str, Any], driver: str, pool: str
) -> list[dict[str, Any]]:
    uid = (found.get("metadata") or {}).get("uid")
    if uid != claim.uid:
        raise ClaimRefused(
            f"claim {claim.describe()} has UID {uid}, not {claim.uid}: "
            "it was deleted and created again"
        )
    allocation = (found.get("status") or {}).get("allocation")
    if not isinstance(allocation, dict):
        raise ClaimRefused(f"claim {claim.describe()} is not allocated")
    results = (allocation.get("devices") or {}).get("results") or []
    if not isinstance(results, list):
        raise ClaimRefused(f"claim {claim.describe()}: allocation results are not a list")
    ours = []
    for result in results:
        if not isinstance(result, dict) or result.get("driver") != driver:
            continue
        if result.get("pool") != pool:
            raise ClaimRefused(
                f"claim {claim.describe()} is allocated device {result.get('device')} of "
                f"pool {result.get('pool')}, not of this node ({pool})"
            )
        ours.append(result)
    return ours


def claim_limits(
    claim: ClaimRef,
    plan: Sequence[tuple[str, Offered, Mapping[str, Any]]],
    unit_mib: int,
    hold: Shares | None = None,
) -> ClaimLimits:
    """What every share of the claim enforces (issue 32 item 2). HAMi-core limits a card
    by the index it has inside the container, and a result cannot know it: the container
    may see the claim's other cards, or only some of them (a container can name one
    request), or another claim's. So each result's CDI device carries the same limits,
    set for every index (``CUDA_DEVICE_MEMORY_LIMIT`` beside ``_0``): the smallest memory
    share of the claim and its smallest core share, and names all of the claim's cards.
    A claim of equal shares (``count: N``) is enforced exactly; unequal shares are all
    held to the smallest, never more than granted. ``hold``: the smallest shares of the
    claims it shares a container with (:mod:`gpushare.dra.mates`), which it never exceeds."""
    memory: list[int] = []
    cores: list[int] = []
    cards: list[tuple[int, str]] = []
    for _request, device, result in plan:
        if not device.shared:
            continue
        try:
            found = share_of(result.get("consumedCapacity"), device.card_memory_mib, unit_mib)
        except ShareError as exc:
            raise ClaimRefused(f"claim {claim.describe()}, device {device.name}: {exc}") from None
        memory.append(found.memory_mib)
        cores.append(found.cores or FULL_CORES)  # 0: no core limit asked
        cards.append((device.card_index, device.uuid))
    if not memory:
        return ClaimLimits()
    charged = (min(memory), min(cores) if min(cores) < FULL_CORES else None)
    if hold is not None:
        memory.append(hold.memory_mib)
        cores.append(hold.cores)
    core_cap = min(cores)
    return ClaimLimits(
        min(memory),
        core_cap if core_cap < FULL_CORES else None,
        tuple(dict.fromkeys(uuid for _i, uuid in sorted(cards))) if len(set(cards)) > 1 else (),
        charged,
    )


def _dig(value: Any, *keys: str) -> Any:
    """``value[k1][k2]...``, None where a step is not a mapping or lacks the key."""
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def claim_shares(
    found: Mapping[str, Any], driver: str, pool: str, offered: Mapping[str, Offered], unit_mib: int
) -> Shares | None:
    """A claim's own smallest shares of this node's cards (what its spec sets, before it
    is held to its mates'); None when it has none. Results of other drivers or pools, or
    naming no device of this node, hold nothing here; a share that cannot be read counts
    as none (that claim's own prepare refuses it)."""
    ref = ClaimRef(str(_dig(found, "metadata", "namespace")), "mate", "")
    results = _dig(found, "status", "allocation", "devices", "results")
    plan = []
    for result in results if isinstance(results, list) else []:
        if not isinstance(result, dict) or (result.get("driver"), result.get("pool")) != (
            driver,
            pool,
        ):
            continue
        device = offered.get(str(result.get("device")))
        if device is not None:
            plan.append(("", device, result))
    try:
        limits = claim_limits(ref, plan, unit_mib)
    except ClaimRefused:
        return None
    if limits.memory_mib is None:
        return None
    return Shares(limits.memory_mib, limits.cores or FULL_CORES)


@dataclass(frozen=True)
class ClaimSource:
    """Where and how a prepare call reads its claims, and whose results are its own."""

    api: ApiClient
    driver: str
    pool: str
    unit_mib: int
    api_timeout: float
    #: this node's pods by UID as the pod watch holds them (``PodWatch.claim_pod``): a
    #: reserving pod found there is not read (:class:`~gpushare.dra.mates.MateReader`)
    watched: Callable[[str], Mapping[str, Any] | None] | None = None


def read_pending(
    source: ClaimSource,
    pending: Sequence[ClaimRef],
    offered: Mapping[str, Offered],
    deadline: float | None,
    cancelled: Callable[[], bool],
) -> tuple[dict[str, tuple[list[dict[str, Any]], Together]], list[tuple[ClaimRef, ClaimRefused]]]:
    """Each claim's results of this driver, and its mates, by UID; and the claims refused
    (not read, or whose mates cannot be told). Past ``deadline`` (``time.monotonic()``)
    or once ``cancelled``, what is not read yet is left out."""
    api, driver, pool, api_timeout = source.api, source.driver, source.pool, source.api_timeout
    found: dict[str, tuple[ClaimRef, dict[str, Any], list[dict[str, Any]]]] = {}
    refused: list[tuple[ClaimRef, ClaimRefused]] = []
    reader = MateReader(
        api,
        lambda obj: claim_shares(obj, driver, pool, offered, source.unit_mib),
        api_timeout=api_timeout,
        deadline=deadline,
        watched=source.watched,
    )
    for claim in pending:
        left = None if deadline is None else deadline - time.monotonic()
        if cancelled() or (left is not None and left <= 0):
            break
        try:
            timeout = api_timeout if left is None else min(api_timeout, left)
            obj = read_claim(api, claim, timeout)
            found[claim.uid] = (claim, obj, results_of(claim, obj, driver, pool))
        except ClaimRefused as exc:
            refused.append((claim, exc))
            continue
        with contextlib.suppress(MatesUnknown):  # its UID was checked: it is known
            reader.know(claim.namespace, claim.name, obj)
    read = {}
    for uid, (claim, obj, results) in found.items():
        try:
            read[uid] = (results, reader.together(claim.namespace, claim.name, obj))
        except MatesUnknown as exc:
            refused.append((claim, ClaimRefused(f"claim {claim.describe()}: {exc}")))
    return read, refused
