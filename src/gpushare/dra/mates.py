"""Which claims share a container, and the limits that hold them together (issue 32 item 2).

HAMi-core limits a card by the index it has inside the container, and the runtime applies
a container's CDI devices in turn, a later one replacing an earlier one's variable of the
same name. Every share result of a claim therefore sets its limits for every index
(:func:`~gpushare.dra.claims.claim_limits`), and a container that uses two claims runs, on
every card it sees, with the limits of whichever claim the runtime applied last. So a
claim is held to the smallest shares of every claim it shares a container with (its
*mates*), and a claim is not prepared while a mate already prepared sets more than the
smallest share of a container they share: whichever order the runtime picks, no card
gets more than it was charged.

The claims a container uses are in its pod's spec: the claim's ``status.reservedFor``
names the pods that may use it (the kubelet prepares a claim for no other pod), each
pod's ``containers[].resources.claims`` (init containers too) name pod claims, and
``spec.resourceClaims`` / ``status.resourceClaimStatuses`` (``extendedResourceClaimStatus``
for extended resources backed by a claim) turn those into ResourceClaim names. A
container naming one request of a claim is counted as using the whole claim (its limits
are the whole claim's anyway). Every pod and claim is read once per prepare call, each
read bounded by the API client's timeout and the kubelet's deadline. A reserving pod is
not read at all where the daemon's pod watch holds it (``watched``: the kubelet prepares
a claim for a pod bound to this node, which the watch sees) with every claim name its
containers use resolved: those fields do not change once set (``spec.resourceClaims``
and the containers' ``resources.claims`` are immutable, a claim status is written once
by the resourceclaim controller, the extended resource's claim by the scheduler before
it binds the pod, so before the watch, which follows the node's pods, can see it); a
pod the watch does not hold, or holds with a claim name not resolved yet, is read. What
cannot be read refuses the claim (the kubelet retries; the claim itself was just read
from the same API server): a guess could let a card be used beyond its charge. A pod
that is gone (not found, or found with another UID) or has ended runs no container
again and is skipped (a pod the watch still holds for a moment after it ended can
only hold a claim to a smaller share, or refuse it until the watch catches up, never
give it more).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from gpushare.dra.checkpoint import ClaimEntry
from gpushare.kube.stdlibclient import ApiClient, ApiStatusError

log = structlog.get_logger(__name__)

#: The most pods a claim may be reserved for (the API server's own limit).
MAX_RESERVED_FOR = 256
#: The most pods and claims one prepare call reads to find the claims' mates.
MAX_READS = 512
TERMINAL_PHASES = ("Succeeded", "Failed")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a pod's or claim's
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")


def _checked(name: str, what: str) -> str:
    """A name that goes into a URL or a file name: refused unless it is one."""
    if not _NAME.match(name):
        raise MatesUnknown(f"{what} {name[:80]!r} is not a valid name")
    return name


class MatesUnknown(Exception):
    """Which claims share a container with this one cannot be told; the one line why."""


@dataclass(frozen=True)
class Shares:
    """The smallest memory share (MiB) and core share (``full``: no core limit) of a
    claim's shares of a card: the limits its CDI spec sets for every index."""

    memory_mib: int
    cores: int

    def within(self, other: Shares) -> bool:
        return self.memory_mib <= other.memory_mib and self.cores <= other.cores

    def describe(self) -> str:
        return f"{self.memory_mib} MiB and {self.cores} cores"


def smallest(shares: Iterable[Shares | None]) -> Shares | None:
    """The smallest memory and the smallest cores among ``shares`` (None: no share)."""
    found = [s for s in shares if s is not None]
    if not found:
        return None
    return Shares(min(s.memory_mib for s in found), min(s.cores for s in found))


@dataclass(frozen=True)
class Mate:
    """A claim a container uses: its name, UID, and its own smallest shares (None: it
    holds no share of a card, so it sets no limit)."""

    name: str
    uid: str
    shares: Shares | None


@dataclass(frozen=True)
class Container:
    """One container that uses the claim, and every claim it uses (that one included)."""

    pod: str  # namespace/name
    name: str
    mates: tuple[Mate, ...]

    def floor(self) -> Shares | None:
        """The smallest shares among its claims: the most any of them may set."""
        return smallest(m.shares for m in self.mates)

    def describe(self) -> str:
        return f"container {self.name[:63]} of pod {self.pod}"


@dataclass(frozen=True)
class Together:
    """The containers that use a claim, and the smallest shares among all their claims."""

    containers: tuple[Container, ...] = ()

    def hold(self) -> Shares | None:
        return smallest(c.floor() for c in self.containers)

    def floors(self, me: str) -> dict[str, list[int]]:
        """Each mate's UID -> the smallest shares of the containers it shares with this
        claim (``me``), as [MiB, cores]: what it must not exceed (recorded with the claim,
        :func:`promised`)."""
        found: dict[str, Shares] = {}
        for container in self.containers:
            floor = container.floor()
            for mate in container.mates:
                if floor is not None and mate.uid != me:
                    found[mate.uid] = smallest([found.get(mate.uid), floor]) or floor
        return {uid: [s.memory_mib, s.cores] for uid, s in sorted(found.items())}


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _names(items: Any) -> list[Mapping[str, Any]]:
    return [i for i in items if isinstance(i, Mapping)] if isinstance(items, list) else []


def claims_by_container(pod: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """Container name -> the ResourceClaim names it uses (containers and init containers).
    Raises :class:`MatesUnknown` when a pod claim a container uses has no claim name yet
    (a template's claim not created: the kubelet does not start the pod either)."""
    spec = _map(pod.get("spec"))
    status = _map(pod.get("status"))
    generated = {
        str(s.get("name")): s.get("resourceClaimName")
        for s in _names(status.get("resourceClaimStatuses"))
    }
    claim_of: dict[str, str | None] = {}
    for entry in _names(spec.get("resourceClaims")):
        name = str(entry.get("name"))
        if entry.get("resourceClaimName"):
            claim_of[name] = str(entry["resourceClaimName"])
        elif name in generated:  # None there: the template asked for no claim
            found = generated[name]
            claim_of[name] = str(found) if found else None
        else:
            raise MatesUnknown(f"pod claim {name[:80]!r} has no ResourceClaim yet")
    used: dict[str, set[str]] = {}
    for key in ("initContainers", "containers"):
        for container in _names(spec.get(key)):
            names = used.setdefault(str(container.get("name")), set())
            for ref in _names(_map(container.get("resources")).get("claims")):
                claim = claim_of.get(str(ref.get("name")))
                if claim:
                    names.add(claim)
    extended = status.get("extendedResourceClaimStatus")
    if isinstance(extended, Mapping) and extended.get("resourceClaimName"):
        for mapping in _names(extended.get("requestMappings")):
            container_name = str(mapping.get("containerName"))
            used.setdefault(container_name, set()).add(str(extended["resourceClaimName"]))
    return {name: frozenset(claims) for name, claims in used.items() if claims}


def reserving_pods(found: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, UID) of the pods a claim is reserved for."""
    reserved = _names(_map(found.get("status")).get("reservedFor"))
    if len(reserved) > MAX_RESERVED_FOR:
        raise MatesUnknown(f"reserved for {len(reserved)} consumers, more than {MAX_RESERVED_FOR}")
    return [
        (str(r.get("name")), str(r.get("uid")))
        for r in reserved
        if r.get("resource") == "pods" and not r.get("apiGroup")
    ]


def _object_uid(found: Any) -> str | None:
    return _map(_map(found).get("metadata")).get("uid")


class MateReader:
    """Finds the mates of the claims of one prepare call.

    ``shares_of`` gives a claim object's own smallest shares on this node (None: none of
    its results is a share of one of this node's cards). ``watched`` gives a pod of this
    node by UID as the pod watch holds it (``PodWatch.claim_pod``), or None. Pods and
    claims are read once, each read bounded by ``api_timeout`` and ``deadline``
    (``time.monotonic()``)."""

    def __init__(
        self,
        api: ApiClient,
        shares_of: Callable[[Mapping[str, Any]], Shares | None],
        *,
        api_timeout: float,
        deadline: float | None,
        watched: Callable[[str], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self.api = api
        self.shares_of = shares_of
        self.watched = watched
        self.api_timeout = api_timeout
        self.deadline = deadline
        self._claims: dict[tuple[str, str], Mate] = {}
        self._pods: dict[tuple[str, str, str], Mapping[str, Any] | None] = {}
        self._reads = 0

    def know(self, namespace: str, name: str, found: Mapping[str, Any]) -> None:
        """A claim this call has read already."""
        uid = str(_object_uid(found))
        if not _UID.match(uid):
            raise MatesUnknown(f"claim {namespace}/{name} has no valid UID")
        known = self._claims.get((namespace, name))
        if known is None or known.uid != uid:  # its shares are read once per call
            self._claims[(namespace, name)] = Mate(name, uid, self.shares_of(found))

    def together(self, namespace: str, name: str, found: Mapping[str, Any]) -> Together:
        """The containers that use this claim, in every pod it is reserved for, with
        every claim each of them uses. Raises :class:`MatesUnknown`."""
        self.know(namespace, name, found)
        containers: list[Container] = []
        for pod_name, pod_uid in reserving_pods(found):
            pod = self._pod(namespace, pod_name, pod_uid)
            if pod is None:
                continue
            for container, claims in sorted(claims_by_container(pod).items()):
                if name not in claims:
                    continue
                mates = tuple(self._claim(namespace, c) for c in sorted(claims))
                containers.append(Container(f"{namespace}/{pod_name}", container, mates))
        return Together(tuple(containers))

    # ------------------------------------------------------------------ reads
    def _read(self, path: str, what: str) -> Any:
        self._reads += 1
        if self._reads > MAX_READS:
            raise MatesUnknown(f"more than {MAX_READS} pods and claims to read in one call")
        timeout = self.api_timeout
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise MatesUnknown(f"the kubelet's call ended before {what} was read")
        try:
            return self.api.get(path, timeout=timeout)
        except ApiStatusError as exc:
            if exc.status == 404:
                return None
            raise MatesUnknown(f"cannot read {what}: {exc}") from None
        except OSError as exc:
            raise MatesUnknown(f"cannot read {what}: API server unreachable ({exc})") from None

    def _pod(self, namespace: str, name: str, uid: str) -> Mapping[str, Any] | None:
        """The pod, or None when it is gone or has ended (it runs no container again)."""
        key = (namespace, _checked(name, "reserved for pod"), uid)
        if key not in self._pods and (known := self._watched(namespace, name, uid)):
            self._pods[key] = known
        if key not in self._pods:
            found = self._read(
                f"/api/v1/namespaces/{namespace}/pods/{name}", f"pod {namespace}/{name}"
            )
            if found is not None and not isinstance(found, Mapping):
                raise MatesUnknown(f"pod {namespace}/{name}: the API server sent no object")
            phase = _map(_map(found).get("status")).get("phase")
            if found is None or _object_uid(found) != uid or phase in TERMINAL_PHASES:
                log.info(
                    "claim_reserving_pod_skipped",
                    pod=f"{namespace}/{name}",
                    uid=uid,
                    reason="ended" if found is not None and _object_uid(found) == uid else "gone",
                )
                found = None
            self._pods[key] = found
        return self._pods[key]

    def _watched(self, namespace: str, name: str, uid: str) -> Mapping[str, Any] | None:
        """The pod as the pod watch holds it, when it names every claim its containers
        use (else None: it is read)."""
        found = self.watched(uid) if self.watched is not None else None
        meta = _map(_map(found).get("metadata"))
        if found is None or (meta.get("namespace"), meta.get("name")) != (namespace, name):
            return None
        try:
            claims_by_container(found)
        except MatesUnknown:  # a template's claim the watch has not seen named yet
            return None
        return found

    def _claim(self, namespace: str, name: str) -> Mate:
        key = (namespace, _checked(name, "a container's claim"))
        if key not in self._claims:
            found = self._read(
                f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
                f"claim {namespace}/{name}",
            )
            if not isinstance(found, Mapping):
                raise MatesUnknown(
                    f"claim {namespace}/{name}, used in the same container, cannot be read"
                )
            self.know(namespace, name, found)
        return self._claims[key]


def overreaching(together: Together, me: str, applied: Callable[[str], Shares | None]) -> str:
    """Why a mate already prepared would let a card of a shared container run above its
    charge ("" when none would): ``applied`` gives what a prepared claim's spec sets
    (None: not prepared, or it sets no limit). ``me``: this claim's UID."""
    for container in together.containers:
        floor = container.floor()
        if floor is None:
            continue
        for mate in container.mates:
            if mate.uid == me:
                continue
            sets = applied(mate.uid)
            if sets is not None and not sets.within(floor):
                return (
                    f"{container.describe()} also uses claim {mate.name}, prepared before "
                    f"with limits of {sets.describe()}, above the smallest share there "
                    f"({floor.describe()}): the runtime may apply them to this claim's "
                    "cards. Not prepared while that claim is; give the claims of one "
                    "container equal shares"
                )
    return ""


def applied_limits(entry: ClaimEntry, full_cores: int) -> Shares | None:
    """The most the CDI spec of a prepared (or recovered) claim sets for any index; None
    when it sets no limit (no share of a card). An entry that does not record them (one
    written before, or rebuilt from the spec) is bounded by its devices' largest values
    (a recovered entry's are the spec's own); a share whose value is unknown counts as
    the largest possible, so such a mate holds back a smaller claim rather than risk it."""
    if entry.memory_limit_mib is not None:
        return Shares(entry.memory_limit_mib, entry.core_limit or full_cores)
    shares = [d for d in entry.devices if not d.mig]
    if not shares:
        return None
    memory = [d.memory_mib for d in shares]
    cores = [d.cores or full_cores for d in shares]
    if any(m is None for m in memory):
        return Shares(1 << 40, full_cores)
    return Shares(max(m for m in memory if m is not None), max(cores))


def promised(entries: Iterable[ClaimEntry], uid: str) -> Shares | None:
    """The smallest shares that the prepared claims recorded for claim ``uid`` as a mate
    (:meth:`Together.floors`). A claim prepared from a read made before a pod reserved it
    does not know that pod's containers; a mate prepared for that pod does, and its
    record holds the claim to the container's smallest share all the same."""
    return smallest(Shares(*e.held_with[uid]) for e in entries if uid in e.held_with)
