"""What occupies a card, as the extender sees it: the node's published state, plus what
happened since that the state cannot show yet.

The daemon publishes each card's used units and the pods they include
(``nodestate.py``). Between two publications three things can happen, and the
extender learns each before the daemon's next annotation does:

* **it binds a pod** (the ``bind`` verb): the pod holds its predicted units per card
  (a *hold*) until the published state lists that pod (its units are then in the
  counts), or the pod is gone;
* **a pod is bound to the node by anyone** (the pod watch, ``podfeed.py``): a live pod
  bound there, asking for gpushare resources, that the published state does not list
  is counted too, on the cards the daemon's own placement would give it (on every
  card when none holds it); the extender's own holds say where its pods go;
* **a pod ends** (deleted, or ``Succeeded``/``Failed``): its units that the published
  state lists are free again at once, and a hold it had ends.

So room is returned only for a pod that is really gone, never on a clock: with the pod
watch running, a hold has no timeout. The timeout (``--ledger-timeout-seconds``) only
ends holds the published state cannot confirm: when the node's daemon lists no pods
(an older daemon: the hold then also ends when the node's generation moves on, as
before), when a card's list is truncated, or while the pod watch is not running.

Listed pods are matched by UID, or by ``namespace/name`` when the daemon did not know
the UID; a name matches only when exactly one live pod of that name is bound to the
node and no ended pod of that name is remembered there (a pod deleted and created
again under its name is ambiguous, and ambiguity counts the room as used).

A restarted extender starts from the published states and a fresh list of the pods
(``podfeed.py``), never from an empty ledger: until that list is read, filters keep
no node (see ``ExtenderState.ready``).

Every operation is O(1) amortised or linear in one node's pods: entries are kept per
node, and in time order for expiry. Everything kept is bounded; past a bound the
oldest goes first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from gpushare.extender.fit import BINPACK, CardRoom, PodNeed, card_rooms, fit_pod, subtract
from gpushare.kube.nodestate import NodeGpuState

#: The most holds kept at once (a cluster binds far fewer pods per minute).
DEFAULT_MAX_HOLDS = 10_000
#: The most live GPU pods remembered from the pod watch.
MAX_LIVE_PODS = 100_000
#: Ended pods are remembered this long (the daemon publishes well within it) ...
GONE_SECONDS = 600.0
#: ... and at most this many.
MAX_GONE_PODS = 50_000
_NEVER = float("inf")
_NONE: frozenset[str] = frozenset()
#: The most nodes whose version is kept (past it every version starts again).
MAX_VERSIONS = 200_000
#: With the pod watch running, a hold no published state ever confirms still ends
#: after this many timeouts (a bound on memory, not on correctness).
WATCHED_HOLD_FACTOR = 10


@dataclass(frozen=True)
class LedgerEntry:
    pod_uid: str
    node: str
    generation: int
    admitted_at: float
    use_by_card: Mapping[str, tuple[int, int]]  # UUID -> (memory units, core units)
    pod_key: str = ""  # namespace/name
    #: the first generation seen counting the pod: older states (a scheduler's copy from
    #: before) still need the hold
    confirmed_in: int | None = None


@dataclass(frozen=True)
class PodFacts:
    """What the pod watch keeps of one pod."""

    uid: str
    key: str  # namespace/name
    node: str  # spec.nodeName; "" while unbound
    need: PodNeed | None  # None: no gpushare container (not kept)
    ended: bool  # Succeeded or Failed (deleted pods come as ``pod_deleted``)
    #: container -> card, as planned by the extender that bound it (``<prefix>/plan``):
    #: the daemon follows it, so a restarted extender counts the pod there too
    plan: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class _Gone:
    uid: str
    key: str
    node: str
    at: float


@dataclass(frozen=True)
class Occupancy:
    """One node's cards as the extender counts them now."""

    rooms: tuple[CardRoom, ...]
    pending: int  # pods counted on top of the published state
    released: int  # ended pods whose listed units were given back
    #: what a cached copy must check (``verdictcache.py``): the pods whose exclusion
    #: (``exclude_pod``) would change the answer, the oldest time an answer depends on
    #: (it changes once the clock passes that plus the timeout), and the pod keys the
    #: state lists (an ending of any of them, on any node, changes the answer)
    touched: frozenset[str] = frozenset()
    oldest: float = float("inf")
    listed: frozenset[str] = frozenset()


class AdmissionLedger:
    """Not thread-safe: the extender's handlers and the pod feed's events run on one
    event loop."""

    def __init__(
        self,
        timeout_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        max_holds: int = DEFAULT_MAX_HOLDS,
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self.max_holds = max_holds
        self._clock = clock
        self._by_time: OrderedDict[str, LedgerEntry] = OrderedDict()  # pod UID -> entry
        self._by_node: dict[str, dict[str, LedgerEntry]] = {}  # node -> pod UID -> entry
        #: True while the pod watch runs and its list has been read (``podfeed.py``)
        self.watching = False
        #: True while a pod watch is configured but its first list is not read yet:
        #: the filter keeps no node then (it would count as if no pod were bound)
        self.awaiting_list = False
        self._live: dict[str, PodFacts] = {}  # uid -> a live pod bound to a node
        self._live_since: dict[str, float] = {}
        self._live_by_node: dict[str, set[str]] = {}
        self._gone: OrderedDict[str, _Gone] = OrderedDict()
        self._gone_by_node: dict[str, dict[str, _Gone]] = {}
        #: node -> a number that changes whenever anything counted on the node does
        self._versions: dict[str, int] = {}
        self._changes = 0
        self._epoch = 0

    def __len__(self) -> int:
        return len(self._by_time)

    # ------------------------------------------------------------------ versions
    def _touch(self, node: str) -> None:
        if len(self._versions) >= MAX_VERSIONS and node not in self._versions:
            self._versions.clear()  # a new epoch: no node's version reads as before
            self._epoch += 1
        self._changes += 1
        self._versions[node] = self._changes

    def version(self, node: str) -> tuple[int, int]:
        """Changes whenever a hold, a live pod or an ended pod counted on ``node`` does:
        a cached occupancy of the same version, state, policy and ``watching``, inside
        its ``oldest`` horizon and with the same ended pods among its ``listed`` keys, is
        the occupancy :meth:`occupancy` computes now (``verdictcache.py``)."""
        return (self._epoch, self._versions.get(node, 0))

    def now(self) -> float:
        return self._clock()

    def gone_among(self, keys: frozenset[str]) -> frozenset[str]:
        """The keys in ``keys`` of pods known to have ended (on any node)."""
        gone = self._gone
        if not keys or gone.keys().isdisjoint(keys):
            return _NONE
        return frozenset(key for key in keys if key in gone)

    def expire(self) -> None:
        """End the holds and forget the ended pods that have outlived their time."""
        self._expire()

    # ------------------------------------------------------------------ holds
    def _drop(self, pod_uid: str) -> None:
        entry = self._by_time.pop(pod_uid, None)
        if entry is None:
            return
        self._touch(entry.node)
        on_node = self._by_node.get(entry.node)
        if on_node is not None:
            on_node.pop(pod_uid, None)
            if not on_node:
                del self._by_node[entry.node]

    def _hold_lifetime(self) -> float:
        factor = WATCHED_HOLD_FACTOR if self.watching else 1
        return self.timeout_seconds * factor

    def _expire(self) -> None:
        now = self._clock()
        horizon = now - self._hold_lifetime()
        while self._by_time:
            uid, entry = next(iter(self._by_time.items()))
            if entry.admitted_at >= horizon:
                break
            self._drop(uid)
        gone_horizon = now - GONE_SECONDS
        while self._gone and next(iter(self._gone.values())).at < gone_horizon:
            self._forget_gone(next(iter(self._gone)))

    def _confirm(self, entry: LedgerEntry, generation: int) -> None:
        confirmed = replace(entry, confirmed_in=generation)
        self._touch(entry.node)
        self._by_time[entry.pod_uid] = confirmed
        self._by_node[entry.node][entry.pod_uid] = confirmed

    def forget_pod(self, pod_uid: str) -> None:
        """Drop the pod's hold (its binding failed, or it is being scheduled again)."""
        self._drop(pod_uid)

    def holds(self, pod_uid: str) -> bool:
        return pod_uid in self._by_time

    def record(
        self,
        pod_uid: str,
        node: str,
        generation: int,
        use_by_card: Mapping[str, tuple[int, int]],
        pod_key: str = "",
    ) -> None:
        """The pod holds ``use_by_card`` on ``node`` (replacing any hold it had)."""
        self._drop(pod_uid)
        if not pod_uid or not use_by_card or pod_uid in self._gone:
            return
        self._expire()
        while len(self._by_time) >= self.max_holds:
            self._drop(next(iter(self._by_time)))
        entry = LedgerEntry(pod_uid, node, generation, self._clock(), dict(use_by_card), pod_key)
        self._by_time[pod_uid] = entry
        self._by_node.setdefault(node, {})[pod_uid] = entry
        self._touch(node)

    # ------------------------------------------------------------------ the pod watch
    def _touch_pod(self, uid: str, node: str) -> None:
        """A pod's live facts change: its node, and the node of its hold, count anew."""
        self._touch(node)
        hold = self._by_time.get(uid)
        if hold is not None and hold.node != node:
            self._touch(hold.node)

    def _forget_live(self, uid: str) -> PodFacts | None:
        facts = self._live.pop(uid, None)
        self._live_since.pop(uid, None)
        if facts is not None:
            self._touch_pod(uid, facts.node)
            on_node = self._live_by_node.get(facts.node)
            if on_node is not None:
                on_node.discard(uid)
                if not on_node:
                    del self._live_by_node[facts.node]
        return facts

    def _forget_gone(self, uid: str) -> None:
        gone = self._gone.pop(uid, None)
        if gone is not None:
            self._touch(gone.node)
            on_node = self._gone_by_node.get(gone.node)
            if on_node is not None:
                on_node.pop(uid, None)
                if not on_node:
                    del self._gone_by_node[gone.node]

    def _ended(self, uid: str, key: str, node: str) -> None:
        self._forget_live(uid)
        self._drop(uid)
        if not uid or uid in self._gone:
            return
        while len(self._gone) >= MAX_GONE_PODS:
            self._forget_gone(next(iter(self._gone)))
        gone = _Gone(uid, key, node, self._clock())
        self._gone[uid] = gone
        self._touch(node)
        if node:
            self._gone_by_node.setdefault(node, {})[uid] = gone

    def pod_seen(self, facts: PodFacts) -> None:
        """A pod as the watch shows it now (added or modified)."""
        if not facts.uid or facts.uid in self._gone:
            return  # an ended pod never comes back (a new one has a new UID)
        if facts.ended:
            hold = self._by_time.get(facts.uid)
            self._ended(facts.uid, facts.key, facts.node or (hold.node if hold else ""))
            return
        known = self._live.get(facts.uid)
        if facts.node and facts.need is not None and facts.need.wants_gpu:
            if known is not None and known.node != facts.node:
                self._forget_live(facts.uid)
            if known is None and len(self._live) >= MAX_LIVE_PODS:
                return
            self._live[facts.uid] = facts
            self._live_since.setdefault(facts.uid, self._clock())
            self._touch_pod(facts.uid, facts.node)
            self._live_by_node.setdefault(facts.node, set()).add(facts.uid)
        elif known is not None:
            self._forget_live(facts.uid)

    def pod_deleted(self, uid: str, key: str, node: str) -> None:
        hold = self._by_time.get(uid)
        self._ended(uid, key, node or (hold.node if hold else ""))

    def pods_listed(self, pods: Iterable[PodFacts]) -> None:
        """A fresh list of every pod: live pods missing from it ended in between."""
        listed = list(pods)
        present = {facts.uid for facts in listed}
        for uid, facts in list(self._live.items()):
            if uid not in present:
                self._ended(uid, facts.key, facts.node)
        for facts in listed:
            self.pod_seen(facts)

    @property
    def live_pods(self) -> int:
        return len(self._live)

    # ------------------------------------------------------------------ reading
    def pending_use(
        self, node: str, generation: int, exclude_pod: str = ""
    ) -> dict[str, tuple[int, int]]:
        """For a node whose daemon lists no pods: UUID -> (memory, core) units held on
        ``node`` by pods bound here that ``generation`` does not count yet (other than
        ``exclude_pod``). A hold ends when the generation moves on, or at the timeout."""
        self._expire()
        horizon = self._clock() - self.timeout_seconds
        total: dict[str, tuple[int, int]] = {}
        for entry in list(self._by_node.get(node, {}).values()):
            if generation != entry.generation or entry.admitted_at < horizon:
                self._drop(entry.pod_uid)
                continue
            if entry.pod_uid == exclude_pod:
                continue
            for uuid, (memory, core) in entry.use_by_card.items():
                held_memory, held_core = total.get(uuid, (0, 0))
                total[uuid] = (held_memory + memory, held_core + core)
        return total

    def pending_pods(self, node: str, exclude_pod: str = "") -> int:
        return sum(1 for uid in self._by_node.get(node, {}) if uid != exclude_pod)

    def occupancy(
        self,
        node: str,
        state: NodeGpuState,
        policy: str = BINPACK,
        exclude_pod: str = "",
        rooms: tuple[CardRoom, ...] | None = None,
    ) -> Occupancy:
        """The node's cards: the published state, less what was bound since, plus what
        ended since. ``exclude_pod`` is left out (a pod scored against its own hold).
        ``rooms``: ``card_rooms(state)`` when the caller has it already (the node cache
        computes it once per published state, not once per request)."""
        if rooms is None:
            rooms = card_rooms(state)
        if not state.cards or any(card.pods is None for card in state.cards):
            held = self.pending_use(node, state.generation, exclude_pod)
            entries = self._by_node.get(node, {})
            return Occupancy(
                subtract(rooms, held),
                self.pending_pods(node, exclude_pod),
                0,
                touched=frozenset(entries),
                oldest=min((entry.admitted_at for entry in entries.values()), default=_NEVER),
            )
        return _count(self, node, state, policy, exclude_pod, rooms)


def _count(
    ledger: AdmissionLedger,
    node: str,
    state: NodeGpuState,
    policy: str,
    exclude_pod: str,
    rooms: tuple[CardRoom, ...],
) -> Occupancy:
    """:meth:`AdmissionLedger.occupancy` for a state that lists its pods."""
    ledger._expire()
    count = _Counting(ledger, node, state, rooms)
    count.release_ended()
    count.subtract_holds(exclude_pod)
    if ledger.watching:
        count.subtract_unlisted(policy, exclude_pod)
    return Occupancy(
        count.rooms,
        count.pending,
        len(count.released_pods),
        frozenset(count.touched),
        count.oldest,
        frozenset(count.listed),
    )


class _Counting:
    """One count of a node's room from a state that lists its pods, in three steps:
    ended pods the state still counts give their units back; the extender's own holds,
    until the state counts the pod, take theirs; live pods bound here by anyone that
    the state does not count yet take theirs."""

    def __init__(
        self,
        ledger: AdmissionLedger,
        node: str,
        state: NodeGpuState,
        rooms: tuple[CardRoom, ...],
    ) -> None:
        self.ledger, self.node, self.state, self.rooms = ledger, node, state, rooms
        self.unconfirmable_after = ledger._clock() - ledger.timeout_seconds
        self.truncated = any(card.pods_truncated for card in state.cards)
        self.live = {uid: ledger._live[uid] for uid in ledger._live_by_node.get(node, ())}
        self.gone = ledger._gone_by_node.get(node, {})
        self.live_names: dict[str, int] = {}
        for facts in self.live.values():
            self.live_names[facts.key] = self.live_names.get(facts.key, 0) + 1
        self.gone_names = {g.key for g in self.gone.values()}
        self.listed = {key for card in state.cards for key, _m, _c in card.pods or ()}
        self.counted: set[str] = set()  # UIDs of live pods the state counts
        for key in self.listed:
            uid = self.live_of(key)
            if uid is not None:
                self.counted.add(uid)
        self.pending = 0
        self.released_pods: set[str] = set()
        self.holding: set[str] = set()
        self.touched: set[str] = set()
        self.oldest = _NEVER  # the answer changes once ``unconfirmable_after`` passes this

    def live_of(self, key: str) -> str | None:
        """The live pod a listed key names, if exactly one."""
        if key in self.live:
            return key
        if "/" in key and self.live_names.get(key) == 1 and key not in self.gone_names:
            return next(uid for uid, facts in self.live.items() if facts.key == key)
        return None

    def ended(self, key: str) -> bool:
        if key in self.gone or key in self.ledger._gone:
            return True
        return "/" in key and key in self.gone_names and not self.live_names.get(key)

    def release_ended(self) -> None:
        """1. Ended pods the state still counts: their units are free."""
        released: dict[str, tuple[int, int]] = {}
        for card in self.state.cards:
            for key, memory, core in card.pods or ():
                if self.ended(key):
                    self.released_pods.add(key)
                    held_memory, held_core = released.get(card.uuid, (0, 0))
                    released[card.uuid] = (held_memory + memory, held_core + core)
        if released:
            self.rooms = tuple(_give(room, released.get(room.uuid, (0, 0))) for room in self.rooms)

    def subtract_holds(self, exclude_pod: str) -> None:
        """2. The extender's own holds, until the state counts the pod."""
        ledger, state, listed = self.ledger, self.state, self.listed
        for entry in list(ledger._by_node.get(self.node, {}).values()):
            by_name = (
                entry.pod_key
                and entry.pod_key in listed
                and self.live_names.get(entry.pod_key, 0) <= 1
                and entry.pod_key not in self.gone_names
            )
            if entry.confirmed_in is not None and state.generation >= entry.confirmed_in:
                continue
            if entry.pod_uid in listed or entry.pod_uid in self.counted or by_name:
                # Confirmed: the counts include it. Once the watch knows the pod, it
                # covers older states too; until then the hold does, for them.
                if entry.pod_uid in ledger._live:
                    ledger._drop(entry.pod_uid)
                elif entry.confirmed_in is None or state.generation < entry.confirmed_in:
                    ledger._confirm(entry, state.generation)
                continue
            if self.truncated or not ledger.watching:
                if entry.admitted_at < self.unconfirmable_after:
                    ledger._drop(entry.pod_uid)
                    continue
                self.oldest = min(self.oldest, entry.admitted_at)
            self.holding.add(entry.pod_uid)
            if entry.pod_uid == exclude_pod:
                continue
            self.rooms = subtract(self.rooms, entry.use_by_card)
            self.pending += 1
        self.touched = set(self.holding)

    def subtract_unlisted(self, policy: str, exclude_pod: str) -> None:
        """3. Live pods bound here by anyone that the state does not count yet (the
        ledger watches the pods)."""
        since = self.ledger._live_since
        for uid, facts in sorted(self.live.items(), key=lambda item: since[item[0]]):
            if uid in self.holding or uid in self.counted or facts.need is None:
                continue
            self.touched.add(uid)
            if uid == exclude_pod:
                continue
            if self.truncated:
                if since[uid] < self.unconfirmable_after:
                    continue
                self.oldest = min(self.oldest, since[uid])
            planned = _planned_use(self.rooms, facts)
            fit = fit_pod(self.rooms, facts.need, policy) if planned is None else None
            if planned is not None:
                self.rooms = subtract(self.rooms, planned)
            elif fit is not None and fit.placement is not None:
                self.rooms = subtract(self.rooms, fit.placement.use_by_card())
            else:  # it fits nowhere that we know: count it everywhere
                need = (facts.need.memory_units, facts.need.core_units)
                self.rooms = subtract(self.rooms, {room.uuid: need for room in self.rooms})
            self.pending += 1


def _planned_use(rooms: Iterable[CardRoom], facts: PodFacts) -> dict[str, tuple[int, int]] | None:
    """The pod's use per card by its plan, if the plan names a card for each of its
    containers and those cards hold them (the daemon follows such a plan)."""
    if facts.need is None or not facts.plan:
        return None
    plan = dict(facts.plan)
    use: dict[str, tuple[int, int]] = {}
    for container in facts.need.containers:
        uuid = plan.get(container.name)
        if uuid is None:
            return None
        memory, core = use.get(uuid, (0, 0))
        use[uuid] = (memory + container.memory_units, core + container.core_units)
    free = {room.uuid: room for room in rooms if room.healthy}
    for uuid, (memory, core) in use.items():
        room = free.get(uuid)
        if room is None or room.memory_free < memory or room.core_free < core:
            return None
    return use


def _give(room: CardRoom, units: tuple[int, int]) -> CardRoom:
    memory, core = units
    return replace(
        room,
        memory_free=min(room.memory_units, room.memory_free + memory),
        core_free=min(room.core_units, room.core_free + core),
    )
