"""What the pods bound to this node ask for: facts for pairing, hints for placement.

The kubelet's GetPreferredAllocation and Allocate do not say which container is being
admitted or what else it will ask for. The pod specs do: a watch on the pods of this
node (see ``podwatch.py``) feeds :class:`PodSpecBook`, and the binder asks it:

* what a container asks for (:meth:`PodSpecBook.requests_of`): the partner decision
  of ``pairing.py`` needs it for the container the kubelet's records name;
* whether an ordinary init container may be mid-admission (:meth:`~PodSpecBook.init_waiting`):
  PodResources never lists those;
* which container is asking now, and what of its pod remains to be placed
  (:meth:`PodSpecBook.asking`): the placement hint that lets a pod be placed whole.

A pod the book does not know is re-read once from the API server (bounded); what the
book cannot tell is reported as unknown, never guessed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.base.quantity import whole_units
from gpushare.kube.nodestate import decode_plan, plan_annotation_key
from gpushare.share.devices import Resource
from gpushare.share.placement import Need
from gpushare.share.records import Snapshot
from gpushare.share.reserved import tampering
from gpushare.share.usage import Holder

TERMINAL_PHASES = ("Succeeded", "Failed")


def _units(resources: Mapping[str, Any] | None, name: str) -> int:
    if not resources:
        return 0
    return whole_units(resources.get(name)) or 0


def exclusive_requests(
    container: Mapping[str, Any], prefix: str, mig_prefix: str | None = None
) -> tuple[str, ...]:
    """The whole-card and MIG resources asked for: ``<prefix>/gpu``, ``<prefix>/mig-*``
    and, where MIG devices are served under another prefix (``nvidia.com`` with
    ``migNvidiaNames``), ``<mig_prefix>/gpu`` and ``<mig_prefix>/mig-*``."""
    limits = (container.get("resources") or {}).get("limits") or {}
    prefixes = {prefix, mig_prefix or prefix}
    return tuple(
        sorted(
            str(name)
            for name in limits
            if any(str(name) == f"{p}/gpu" or str(name).startswith(f"{p}/mig-") for p in prefixes)
        )
    )


def container_requests(container: Mapping[str, Any], prefix: str) -> dict[Resource, int]:
    """Units of each gpushare resource a container spec asks for (limits, else requests)."""
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    return {
        r: _units(limits, r.name_with(prefix)) or _units(requests, r.name_with(prefix))
        for r in Resource
    }


@dataclass(frozen=True)
class SpecContainer:
    """One GPU container of a pod, in the kubelet's admission order."""

    name: str
    needs: dict[Resource, int]
    #: An ordinary (not restartable) init container: it runs alone, before the app
    #: containers, and PodResources does not list it.
    init: bool = False
    #: Whole-card or MIG resources it asks for besides its shared units (full names): a
    #: container that mixes the kinds is refused (the two would name different cards).
    exclusive: tuple[str, ...] = ()
    #: Why its own spec may change its limits (``share/reserved.py``: env, envFrom or
    #: mounts, under every device-list strategy); "" when it cannot.
    tampers: str = ""

    @property
    def need(self) -> Need:
        return Need(self.needs.get(Resource.MEMORY, 0), self.needs.get(Resource.CORE, 0))


@dataclass(frozen=True)
class _Entry:
    namespace: str
    name: str
    phase: str
    containers: tuple[SpecContainer, ...]  # GPU containers only, in admission order
    deleting: bool = False  # deletionTimestamp set: on its way out, never being admitted
    #: container -> the card the scheduler extender planned for it (``<prefix>/plan``)
    plan: tuple[tuple[str, str], ...] = ()


def read_pod(
    pod: Mapping[str, Any], prefix: str, mig_prefix: str
) -> tuple[str, _Entry | None]:
    """(uid, what the book keeps of the pod, or None when it holds no live GPU container)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    uid = str(meta.get("uid", ""))
    containers = []
    for init, listed in ((True, spec.get("initContainers")), (False, spec.get("containers"))):
        for container in listed or []:
            wanted = container_requests(container, prefix)
            if any(wanted.values()):
                containers.append(_kept(container, wanted, prefix, mig_prefix, init=init))
    phase = str((pod.get("status") or {}).get("phase", "Pending"))
    if not uid or not containers or phase in TERMINAL_PHASES:
        return uid, None
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    deleting = bool(meta.get("deletionTimestamp"))
    annotations = meta.get("annotations")
    text = (
        annotations.get(plan_annotation_key(prefix))
        if isinstance(annotations, Mapping)
        else None
    )
    plan = tuple(sorted(decode_plan(text).items()))
    return uid, _Entry(namespace, name, phase, tuple(containers), deleting, plan)


def _kept(
    container: Mapping[str, Any],
    wanted: dict[Resource, int],
    prefix: str,
    mig_prefix: str,
    *,
    init: bool,
) -> SpecContainer:
    """A GPU container as kept (an init container not a sidecar runs alone)."""
    return SpecContainer(
        str(container.get("name", "")),
        wanted,
        init=init and container.get("restartPolicy") != "Always",
        exclusive=exclusive_requests(container, prefix, mig_prefix),
        tampers=tampering(container) or "",
    )


def _planned(entry: _Entry, container: str) -> tuple[str, ...] | None:
    """The extender's card for each container placed together from ``container`` on,
    or None if it planned not all of them (an init container is never planned: it fits
    anywhere alone)."""
    names = [c.name for c in entry.containers]
    if container not in names or not entry.plan:
        return None
    rest = entry.containers[names.index(container) :]
    if rest[0].init:
        return None
    plan = dict(entry.plan)
    cards = tuple(plan.get(c.name, "") for c in rest if not c.init)
    return cards if cards and all(cards) else None


def _plan_from(containers: Sequence[SpecContainer]) -> list[Need]:
    """What to place together, starting with the first of ``containers``: an init
    container alone, an app container with the app containers after it."""
    if containers[0].init:
        return [containers[0].need]
    return [c.need for c in containers if not c.init]


class PodSpecBook:
    """Thread-safe record of the GPU containers of pods on this node.

    The book keeps what :func:`read_pod` reads of each pod and re-reads the pods
    (``on_miss``) when they cannot answer; which container is being admitted is decided
    over a copy of its entries by the pure functions below it (:func:`_candidates`,
    :func:`_agreed`, :func:`_mixer`)."""

    def __init__(self, prefix: str, mig_prefix: str | None = None) -> None:
        self.prefix = prefix
        #: the prefix MIG devices are served under (``nvidia.com`` with ``migNvidiaNames``)
        self.mig_prefix = mig_prefix or prefix
        #: Called when no known pod can be the one asking; re-reads the pods, True if done.
        self.on_miss: Callable[[], bool] | None = None
        self._lock = threading.Lock()
        self._pods: dict[str, _Entry] = {}  # by pod uid

    def name_mig_resources_under(self, mig_prefix: str) -> None:
        """For a book made before the node's settings were final (the fast suite hands
        the daemon one): the prefix MIG devices are served under, known once the core
        is built (before the daemon reads any pod)."""
        self.mig_prefix = mig_prefix

    def update(self, pod: Mapping[str, Any]) -> None:
        """Record (or replace) a pod as the API server shows it."""
        uid, entry = read_pod(pod, self.prefix, self.mig_prefix)
        if not uid:
            return
        with self._lock:
            if entry is None:
                self._pods.pop(uid, None)
            else:
                self._pods[uid] = entry

    def remove(self, uid: str) -> None:
        with self._lock:
            self._pods.pop(uid, None)

    def replace_all(self, pods: list[Mapping[str, Any]]) -> None:
        """Swap in a fresh list at once: a reader never sees a half-filled book."""
        fresh = {}
        for pod in pods:
            uid, entry = read_pod(pod, self.prefix, self.mig_prefix)
            if uid and entry is not None:
                fresh[uid] = entry
        with self._lock:
            self._pods = fresh

    def __len__(self) -> int:
        with self._lock:
            return len(self._pods)

    def _find(self, holder: Holder, *, pending_only: bool) -> _Entry | None:
        """The live pod of that name (not being deleted; the book keeps no terminal
        pod); with ``pending_only``, only a Pending one. Two live copies are ambiguous:
        None."""
        with self._lock:
            live = [
                entry
                for entry in self._pods.values()
                if (entry.namespace, entry.name) == (holder.namespace, holder.pod)
                and (entry.phase == "Pending" or not pending_only)
                and not entry.deleting
            ]
        return live[0] if len(live) == 1 else None

    def uid_of(self, namespace: str, name: str) -> str | None:
        """The UID of the pod of that name on record (None if unknown)."""
        with self._lock:
            for uid, entry in self._pods.items():
                if (entry.namespace, entry.name) == (namespace, name):
                    return uid
        return None

    def requests_of(self, holder: Holder) -> dict[Resource, int] | None:
        """Units of each resource the named container asks for; None if the book
        cannot tell.

        From the book as the watch left it, only a Pending pod of that name speaks: a
        copy that runs may be a pod deleted and created again while the watch lags.
        Otherwise the pods are re-read once (bounded, rate-limited): the API server
        holds at most one pod of a name, so after that fresh read the one live pod of
        that name speaks whatever its phase. A container bound moments ago by a pod
        that has started since (Running) is still the holder the records name, and its
        spec is still a fact (issue 23 item 8)."""
        entry = self._find(holder, pending_only=True)
        if entry is None and self.on_miss is not None and self.on_miss():
            entry = self._find(holder, pending_only=False)
        if entry is None:
            return None
        for container in entry.containers:
            if container.name == holder.container:
                return dict(container.needs)
        return {resource: 0 for resource in Resource}  # a container with no GPU units

    def mixer_being_admitted(
        self, records: Snapshot, shared: Resource | None = None, exclusive: str | None = None
    ) -> Holder | None:
        """A container asking for shared units together with whole cards or MIG devices
        that is being admitted now and would get this request: it holds units of one kind
        (per the fresh ``records``) and still waits for ``shared`` (or ``exclusive``).
        The kubelet admits one container at a time, so such a container is the asker."""
        with self._lock:
            pods = [e for e in self._pods.values() if e.phase == "Pending" and not e.deleting]
        return _mixer(pods, records, shared, exclusive)

    def init_waiting(self, bound: Resource, bound_size: int, resource: Resource, size: int) -> bool:
        """Whether an ordinary init container asking ``bound_size`` of ``bound`` and
        ``size`` of ``resource`` may be mid-admission (PodResources never lists those).

        "No" needs proof: a fresh re-read of the pods (bounded) that shows no pending pod
        with such an init container. Without a way to re-read, or when the re-read fails
        or is refused by its rate limit, the answer is "yes, maybe"."""

        def found() -> bool:
            with self._lock:
                return any(
                    c.init and c.needs.get(bound, 0) == bound_size and c.needs.get(resource) == size
                    for entry in self._pods.values()
                    if entry.phase == "Pending" and not entry.deleting
                    for c in entry.containers
                )

        if found():
            return True
        if self.on_miss is None or not self.on_miss():
            return True
        return found()

    def asking(
        self,
        resource: Resource,
        size: int,
        records: Snapshot | None,
        last_holder: Holder | None = None,
    ) -> list[Need] | None:
        """The needs of the container now asking ``size`` units of ``resource``, first,
        followed by those to be placed together with it (the app containers after it in
        its pod); None when the pods on record do not say which container it is.

        The kubelet admits one pod at a time and its containers in order (init
        containers, then app containers). So if the pod of the container bound last has
        a GPU container still holding nothing, that one is asking; otherwise it is the
        first GPU container of a pod none of whose app containers holds units yet.
        Candidates must ask exactly ``size`` of ``resource``; if they disagree on what
        to place, the answer is only what they agree on (or nothing).
        """
        return self.asking_planned(resource, size, records, last_holder)[0]

    def asking_planned(
        self,
        resource: Resource,
        size: int,
        records: Snapshot | None,
        last_holder: Holder | None = None,
    ) -> tuple[list[Need] | None, list[tuple[str, ...]]]:
        """:meth:`asking`, and the extender's plans for those containers: one per pod it
        can be that needs what the answer places (alike pods are interchangeable)."""
        found = self._asking(resource, size, records, last_holder)
        if not found:
            return None, []
        agreed = _agreed([needs for _holder, needs in found])
        plans = []
        for holder, needs in found:
            if needs != agreed:
                continue
            cards = _plan_of(self, holder)
            if cards is not None:
                plans.append(cards)
        return agreed, plans

    def named(self, namespace: str, name: str) -> list[tuple[str, _Entry]]:
        """(UID, entry) of the pods of that name on record (several while one goes away)."""
        with self._lock:
            return [
                (u, e) for u, e in self._pods.items() if (e.namespace, e.name) == (namespace, name)
            ]

    def asking_without_memory(
        self, size: int, records: Snapshot | None, last_holder: Holder | None = None
    ) -> Holder | None:
        """The container now asking ``size`` core units, when the pods on record show
        it asks no memory units (none, or 0: the kubelet skips a zero quantity), so that
        it would run with the whole card's memory; None when it asks memory or the book
        cannot tell which container it is. Every candidate must agree."""
        candidates = self._asking(Resource.CORE, size, records, last_holder)
        if not candidates or any(plan[0].memory for _holder, plan in candidates):
            return None
        return candidates[0][0]

    def _asking(
        self,
        resource: Resource,
        size: int,
        records: Snapshot | None,
        last_holder: Holder | None,
    ) -> list[tuple[Holder, list[Need]]]:
        held = records.devices if records is not None else {}
        candidates = self._candidates(resource, size, held, last_holder)
        if not candidates and self.on_miss is not None and self.on_miss():
            candidates = self._candidates(resource, size, held, last_holder)
        return candidates

    def _candidates(
        self,
        resource: Resource,
        size: int,
        held: Mapping[Holder, Any],
        last_holder: Holder | None,
    ) -> list[tuple[Holder, list[Need]]]:
        with self._lock:
            pods = list(self._pods.values())
        return _candidates(pods, resource, size, held, last_holder)

def asking_tampering(
    book: PodSpecBook,
    resource: Resource,
    size: int,
    records: Snapshot | None,
    last_holder: Holder | None = None,
) -> tuple[Holder, str] | None:
    """The container now asking ``size`` units of ``resource`` when its own spec sets
    what carries its limits (reserved env names, envFrom without a safe prefix, a volume
    over the interposer: ``share/reserved.py``; under every device-list strategy, a
    grant's CDI spec replaces only the names it sets), with why; None when the book
    cannot tell which container asks, or it does not tamper.

    Only when EVERY candidate the records and specs leave tampers (issue 41 item 10):
    the device-plugin API does not name the pod, so refusing because one candidate
    tampers let a tenant deny GPU admission to every pod of its shape that was pending
    beside its own. With the admission policy in force such a pod never reaches the
    node; this speaks only where the policy is off, and where it cannot be sure it
    admits, and the grant's CDI spec (a CDI strategy) replaces what it sets."""
    candidates = book._asking(resource, size, records, last_holder)
    found = [(holder, _tampers(book, holder)) for holder, _plan in candidates]
    if not found or not all(why for _holder, why in found):
        return None
    return found[0]


def _tampers(book: PodSpecBook, holder: Holder) -> str:
    """What ``holder``'s own spec sets that carries its limits ("" nothing)."""
    for _uid, entry in book.named(holder.namespace, holder.pod):
        for container in entry.containers:
            if container.name == holder.container and container.tampers:
                return container.tampers
    return ""


def holder_live(book: PodSpecBook, holder: Holder) -> bool:
    """Whether the holder's pod is on record and not being deleted (the book keeps no
    terminal pod)."""
    return any(not entry.deleting for _uid, entry in book.named(holder.namespace, holder.pod))


def only_uid_of(book: PodSpecBook, namespace: str, name: str) -> str | None:
    """The UID of the one pod of that name on record; None if none or several (a pod
    deleted and created again under its name while the old one still goes away)."""
    entries = book.named(namespace, name)
    return entries[0][0] if len(entries) == 1 else None


def _plan_of(book: PodSpecBook, holder: Holder) -> tuple[str, ...] | None:
    entries = book.named(holder.namespace, holder.pod)
    return _planned(entries[0][1], holder.container) if len(entries) == 1 else None


def _candidates(
    pods: Sequence[_Entry],
    resource: Resource,
    size: int,
    held: Mapping[Holder, Any],
    last_holder: Holder | None,
) -> list[tuple[Holder, list[Need]]]:
    """The containers that can be the one asking ``size`` units of ``resource`` now,
    each with what to place together with it: the next GPU container holding nothing
    in the pod of ``last_holder`` (the container bound last), else the first GPU
    container of each Pending pod none of whose app containers holds units yet."""

    def holds(entry: _Entry, container: SpecContainer) -> bool:
        return Holder(entry.namespace, entry.name, container.name) in held

    if last_holder is not None:
        for entry in pods:
            if (entry.namespace, entry.name) != (last_holder.namespace, last_holder.pod):
                continue
            names = [c.name for c in entry.containers]
            if last_holder.container not in names:
                break
            after = entry.containers[names.index(last_holder.container) + 1 :]
            rest = [c for c in after if not holds(entry, c)]
            if rest and rest[0].needs.get(resource, 0) == size:
                return [(Holder(entry.namespace, entry.name, rest[0].name), _plan_from(rest))]
            break
    found = []
    for entry in pods:
        if entry.phase != "Pending" or entry.deleting:
            continue
        if any(holds(entry, c) for c in entry.containers if not c.init):
            continue
        first = entry.containers[0]
        if first.needs.get(resource, 0) == size:
            holder = Holder(entry.namespace, entry.name, first.name)
            found.append((holder, _plan_from(entry.containers)))
    return found


def _agreed(candidates: list[list[Need]]) -> list[Need] | None:
    """What the candidates agree on placing: all of it, only the asker, or nothing."""
    first = candidates[0]
    if all(c == first for c in candidates):
        return first
    if all(c[0] == first[0] for c in candidates):
        return first[:1]
    return None


def _mixer(
    pods: Sequence[_Entry], records: Snapshot, shared: Resource | None, exclusive: str | None
) -> Holder | None:
    """The container of ``pods`` (Pending) asking shared units and whole cards or MIG
    devices that holds one kind per ``records`` and still waits for ``shared`` (or
    ``exclusive``): see :meth:`PodSpecBook.mixer_being_admitted`."""
    holding_exclusive = {h for held in records.exclusive.values() for h in held.values()}
    for entry in pods:
        for c in entry.containers:
            if not c.exclusive:
                continue
            holder = Holder(entry.namespace, entry.name, c.name)
            held = records.devices.get(holder, {})
            waits_shared = (
                shared is not None
                and holder in holding_exclusive
                and bool(c.needs.get(shared, 0))
                and not held.get(shared)
            )
            waits_exclusive = (
                exclusive is not None
                and exclusive in c.exclusive
                and bool(held)
                and holder not in set(records.exclusive.get(exclusive, {}).values())
            )
            if waits_shared or waits_exclusive:
                return holder
    return None
