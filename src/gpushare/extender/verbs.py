"""The filter and prioritize verbs over the scheduler's JSON, without HTTP.

kube-scheduler sends ExtenderArgs from Go types without JSON tags, so the keys arrive
capitalised (``Pod``, ``Nodes``, ``NodeNames``); Go reads answers case-insensitively.
With ``nodeCacheCapable: true`` (the sample configuration) only ``NodeNames`` arrive and
the cards come from the extender's own watch of the Nodes (``nodecache.py``); the
answer is names too. With ``nodeCacheCapable: false`` (older configurations, still
served during a rollout) the nodes arrive as full Node objects in ``Nodes.items``, and
the filter answers them the same way. Either way a node dropped without an entry in
``FailedNodes`` would vanish without a reason in the pod's events.

The ``bind`` verb is where a pod starts to hold room (see ``ledger.py``): the filter
only remembers what the pod needs and what each node published, and the binding
checks the pod still fits the chosen node, counting the pods bound before it, and
records the hold. Posting the Binding to the API server is the HTTP layer's part.
"""

from __future__ import annotations

import calendar
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from gpushare.extender.body import BadRequest
from gpushare.extender.choice import card_choice_of, excluded_rooms
from gpushare.extender.fit import (
    BINPACK,
    CardRoom,
    Fit,
    PodNeed,
    PodSpecError,
    fit_pod,
    pod_need,
    score,
)
from gpushare.extender.ledger import AdmissionLedger, Occupancy
from gpushare.extender.nodecache import NodeCache, node_name, read_node_state
from gpushare.extender.verdictcache import VerdictCache
from gpushare.kube import nodestate
from gpushare.share.gputype import CardChoice

__all__ = ["BadRequest", "ExtenderPolicy", "ExtenderState", "bind_verb", "filter_verb"]

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """A mapping that keeps only the ``limit`` most recently written keys."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: K, value: V) -> None:
        self._items.pop(key, None)
        self._items[key] = value
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def pop(self, key: K) -> V | None:
        return self._items.pop(key, None)


#: Pods filtered and not bound yet, and nodes seen, that the extender remembers.
MAX_REMEMBERED_PODS = 10_000
MAX_REMEMBERED_NODES = 50_000


@dataclass
class ExtenderState:
    """What the verbs remember between calls (all of it bounded)."""

    ledger: AdmissionLedger
    #: pod UID -> what it needs, from its latest filter call
    pods: Recent[str, PodNeed] = field(default_factory=lambda: Recent(MAX_REMEMBERED_PODS))
    #: node name -> its latest published state, from filter and prioritize calls
    nodes: Recent[str, nodestate.NodeGpuState] = field(
        default_factory=lambda: Recent(MAX_REMEMBERED_NODES)
    )
    #: wall clock (seconds since the epoch), to bound the timestamps requests carry
    clock: Callable[[], float] = time.time
    #: the node watch's cache, for requests by name (None: no watch, names refused)
    node_cache: NodeCache | None = None
    #: each node's occupancy and verdict per pod shape, while they hold
    verdicts: VerdictCache[Judged] = field(default_factory=VerdictCache)


@dataclass(frozen=True)
class ExtenderPolicy:
    resource_prefix: str = "gpushare.io"
    placement: str = BINPACK


def _get(mapping: Mapping[str, Any], key: str) -> Any:
    """``mapping[key]`` with Go's case-insensitive matching of JSON keys."""
    if key in mapping:
        return mapping[key]
    lowered = key.lower()
    for name, value in mapping.items():
        if isinstance(name, str) and name.lower() == lowered:
            return value
    return None


@dataclass(frozen=True)
class ExtenderArgs:
    pod: Mapping[str, Any]
    pod_uid: str
    pod_label: str
    nodes: list[Mapping[str, Any]]
    #: the node names when the scheduler sent names only (nodeCacheCapable: true)
    names: list[str] | None = None


def read_args(body: Any, state: ExtenderState | None = None) -> ExtenderArgs:
    """Validate an ExtenderArgs body; every mistake is a :class:`BadRequest` (names
    alone too when ``state`` has no node watch to look them up in)."""
    if not isinstance(body, Mapping):
        raise BadRequest("the body must be a JSON object with Pod and Nodes (ExtenderArgs)")
    pod = _get(body, "Pod")
    if not isinstance(pod, Mapping):
        raise BadRequest("Pod is missing or not an object")
    nodes = _get(body, "Nodes")
    names: list[str] | None = None
    items: Any = []
    if nodes is None:
        given = _get(body, "NodeNames")
        if given is None:
            raise BadRequest("Nodes is missing (and NodeNames too)")
        if not isinstance(given, list) or not all(
            isinstance(n, str) and 0 < len(n) <= 253 for n in given
        ):
            raise BadRequest("NodeNames must be a list of node names")
        names = list(given)
        if state is not None and state.node_cache is None:
            raise BadRequest(
                "got NodeNames only, and this extender has no node watch (it needs the API "
                "server and list/watch on nodes): configure it with nodeCacheCapable: false "
                "or give it the API server"
            )
    else:
        if not isinstance(nodes, Mapping):
            raise BadRequest("Nodes must be an object with items (a NodeList)")
        items = _get(nodes, "items")
        if items is None:
            items = []
        if not isinstance(items, list):
            raise BadRequest("Nodes.items must be a list of Node objects")
        for position, node in enumerate(items):
            if not isinstance(node, Mapping) or not node_name(node):
                raise BadRequest(f"Nodes.items[{position}] is not a Node with metadata.name")
    meta = pod.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise BadRequest("Pod.metadata must be an object")
    name = f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"[:300]
    uid = str(meta.get("uid") or "")[:253] or name
    return ExtenderArgs(pod=pod, pod_uid=uid, pod_label=name, nodes=list(items), names=names)


@dataclass(frozen=True)
class NodeVerdict:
    name: str
    fit: Fit
    generation: int | None
    #: why, in a word (the metrics' label): fits, no_room, held, no_gpus, no_annotation,
    #: bad_annotation, kubelet_restart
    code: str = "fits"


@dataclass
class Judged:
    """A verdict kept for one node and pod shape (``verdictcache.py``), and its score
    under the policy once asked."""

    verdict: NodeVerdict
    score: int | None = None


def judge_state(
    name: str,
    state: nodestate.NodeGpuState,
    need: PodNeed,
    policy: ExtenderPolicy,
    ledger: AdmissionLedger,
    exclude_pod: str = "",
    choice: CardChoice | None = None,
    rooms: tuple[CardRoom, ...] | None = None,
    cache: VerdictCache[Judged] | None = None,
    shape: int = -1,
) -> NodeVerdict:
    """Fit the pod on the node's cards as the ledger counts them (the published state,
    less pods bound since, plus pods ended since) less the cards the pod's annotations
    exclude. With a ``cache`` and the pod's ``shape`` (``cache.shape((need, choice))``)
    the occupancy and the verdict are kept while they hold (``verdictcache.py``)."""
    verdict, _judged = judge_kept(
        name, state, need, policy, ledger, exclude_pod, choice, rooms, cache, shape
    )
    return verdict


def judge_kept(
    name: str,
    state: nodestate.NodeGpuState,
    need: PodNeed,
    policy: ExtenderPolicy,
    ledger: AdmissionLedger,
    exclude_pod: str = "",
    choice: CardChoice | None = None,
    rooms: tuple[CardRoom, ...] | None = None,
    cache: VerdictCache[Judged] | None = None,
    shape: int = -1,
) -> tuple[NodeVerdict, Judged | None]:
    """:func:`judge_state`, and the cache's record of the verdict (None: not kept)."""
    if state.kubelet_restarted:
        reason = (
            f"the node's kubelet restarted at {state.kubelet_restarted[:40]} and does not list "
            "every pod that held GPU units yet (it may still count the devices of pods "
            "deleted before the restart); the gpushare daemon says when it does, and the "
            "pod is retried"
        )
        return NodeVerdict(name, Fit(None, reason), state.generation, "kubelet_restart"), None
    if ledger.awaiting_list:
        reason = (
            "the extender has not read the cluster's pods yet (it counts the pods bound "
            "to each node); the pod is retried"
        )
        return NodeVerdict(name, Fit(None, reason), state.generation, "not_ready"), None
    if cache is None or shape < 0:
        occupancy = ledger.occupancy(name, state, policy.placement, exclude_pod, rooms)
        return fit_verdict(name, state, occupancy, need, policy, choice), None
    occupancy, memo = cache.occupancy(ledger, name, state, policy.placement, exclude_pod, rooms)
    if memo is None:
        return fit_verdict(name, state, occupancy, need, policy, choice), None
    judged = memo.get(shape)
    if judged is None:
        judged = memo[shape] = Judged(fit_verdict(name, state, occupancy, need, policy, choice))
    return judged.verdict, judged


def fit_verdict(
    name: str,
    state: nodestate.NodeGpuState,
    occupancy: Occupancy,
    need: PodNeed,
    policy: ExtenderPolicy,
    choice: CardChoice | None,
) -> NodeVerdict:
    """The pod's fit on the node's cards as counted (``occupancy``), less the cards its
    choice excludes."""
    rooms, excluded = excluded_rooms(occupancy.rooms, state, choice)
    if excluded and len(excluded) == len(rooms):
        reason = f"the pod's card choice excludes every card: {', '.join(excluded)}"
        return NodeVerdict(name, Fit(None, reason), state.generation, "card_choice")
    fit = fit_pod(rooms, need, policy.placement)
    if fit.fits:
        return NodeVerdict(name, fit, state.generation)
    if excluded:
        fit = Fit(None, f"{fit.reason} (excluded by the pod's card choice: {', '.join(excluded)})")
    if occupancy.pending:
        reason = (
            f"{fit.reason} (counting {occupancy.pending} pod(s) bound here that the node's "
            "annotation does not show yet)"
        )
        return NodeVerdict(name, Fit(None, reason), state.generation, "held")
    return NodeVerdict(name, fit, state.generation, "no_room")


@dataclass(frozen=True)
class Question:
    """What one filter or prioritize asks of every node it names: the pod's need, its
    card choice, the pod left out of the counts (prioritize: its own hold), and the
    shape's number in the verdict cache (-1: nothing kept)."""

    need: PodNeed
    choice: CardChoice | None = None
    exclude_pod: str = ""
    shape: int = -1


def judge_node(
    node: Mapping[str, Any], question: Question, policy: ExtenderPolicy, state: ExtenderState
) -> tuple[NodeVerdict, Judged | None]:
    """Read one Node's published cards, remember them, and fit the pod on them less the
    cards the pod's annotations exclude (``question.choice``); the verdict, and the
    cache's record of it (None: not kept)."""
    name = node_name(node)
    if state.node_cache is not None:
        # The extender's own feed (the node watch and the state objects): what a request
        # carries is never believed over it (issue 41.7: one filter whose Nodes carried
        # the next generation with every unit used made empty nodes look full until the
        # daemon's next publish).
        return judge_name(name, question, policy, state)
    published, code, reason = read_node_state(node, policy.resource_prefix)
    if published is None:
        return NodeVerdict(name, Fit(None, reason), None, code), None
    seen = state.nodes.get(name)
    doubt = implausible(seen, published, state.clock())
    if doubt:
        if seen is None:
            return NodeVerdict(name, Fit(None, doubt), None, "bad_annotation"), None
        published = seen  # the request's copy is not believed: what was seen stands
    return judge_published(name, published, question, policy, state)


def judge_name(
    name: str, question: Question, policy: ExtenderPolicy, state: ExtenderState
) -> tuple[NodeVerdict, Judged | None]:
    """Like :func:`judge_node` for a node named only: its cards come from the node
    watch's cache."""
    cache = state.node_cache
    if cache is None or not cache.listed:
        reason = (
            "the extender has not read the cluster's Nodes yet (it keeps their cards from "
            "its own watch); the pod is retried"
        )
        return NodeVerdict(name, Fit(None, reason), None, "not_ready"), None
    record = cache.get(name)
    if record is None:
        reason = "the extender's node watch has not seen this node yet; the pod is retried"
        return NodeVerdict(name, Fit(None, reason), None, "unseen"), None
    if record.state is None:
        return NodeVerdict(name, Fit(None, record.reason), None, record.code), None
    return judge_published(name, record.state, question, policy, state, record.rooms)


def judge_published(
    name: str,
    published: nodestate.NodeGpuState,
    question: Question,
    policy: ExtenderPolicy,
    state: ExtenderState,
    rooms: tuple[CardRoom, ...] | None = None,
) -> tuple[NodeVerdict, Judged | None]:
    """Remember the node's newest state seen and fit the pod on it (``rooms``: the
    given state's ``card_rooms``, if known)."""
    chosen = newest(state.nodes.get(name), published)
    state.nodes.put(name, chosen)
    if chosen is not published:
        rooms = None
    return judge_kept(
        name,
        chosen,
        question.need,
        policy,
        state.ledger,
        question.exclude_pod,
        question.choice,
        rooms,
        state.verdicts,
        question.shape,
    )


#: How far a node's ``updated`` may be ahead of the extender's clock (clock skew).
MAX_CLOCK_SKEW_SECONDS = 60.0
#: The daemon publishes at most once per this many seconds (``apilink.MIN_PUBLISH_INTERVAL``),
#: so its generation grows by at most one per this much time between two states.
MIN_PUBLISH_SECONDS = 0.5


def _epoch(updated: str) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(updated, "%Y-%m-%dT%H:%M:%SZ")))
    except (ValueError, OverflowError):
        return None


def implausible(
    seen: nodestate.NodeGpuState | None, given: nodestate.NodeGpuState, now: float
) -> str:
    """Why a state a request carries cannot be the daemon's (issue 32.15), or "".

    A filter's input must never outrank what the daemon publishes: its timestamp may be
    at most :data:`MAX_CLOCK_SKEW_SECONDS` ahead of the extender's clock, and its
    generation at most one per :data:`MIN_PUBLISH_SECONDS` ahead of the state seen
    before, counted between their timestamps (plus the second they round away). A state
    with no readable timestamp sorts before every dated one. A forged state passing both is
    replaced by the daemon's next publish (a later timestamp), or by its read-back (at
    least every 60 s, ``apilink.RESYNC_SECONDS``: it rewrites an annotation that is not
    what it wrote); a node with a state object is judged by that object, never by the
    annotation a request carries."""
    when = _epoch(given.updated)
    if when is None:  # sorts before every dated state: the daemon's next one replaces it
        return ""
    if when > now + MAX_CLOCK_SKEW_SECONDS:
        return (
            f"the node's gpushare annotation is dated {given.updated}, ahead of the "
            f"extender's clock by more than {int(MAX_CLOCK_SKEW_SECONDS)} s (a clock skew, "
            "or not written by the gpushare daemon); not used"
        )
    if seen is None:
        return ""
    before = _epoch(seen.updated)
    elapsed = max(0.0, when - before) if before is not None else 0.0
    # timestamps have whole seconds: one more second's publishes
    step = int((elapsed + 1.0) / MIN_PUBLISH_SECONDS) + 1
    if given.generation > seen.generation + step:
        return (
            f"the node's gpushare annotation is at generation {given.generation}, more than "
            f"its daemon can have published since generation {seen.generation}; not used"
        )
    return ""


def newest(
    seen: nodestate.NodeGpuState | None, given: nodestate.NodeGpuState
) -> nodestate.NodeGpuState:
    """The newer of the node's state seen before and the one a request carries: a
    scheduler's copy may be older than one seen already (the extender has then dropped
    holds that only the newer one confirms). A lower generation with a later timestamp
    is a daemon that started counting again (its annotation was removed): the new one.
    Both are plausible (:func:`implausible`)."""
    if seen is None or given.generation >= seen.generation or given.updated > seen.updated:
        return given
    return seen


def _need(args: ExtenderArgs, policy: ExtenderPolicy) -> PodNeed:
    try:
        return pod_need(args.pod, policy.resource_prefix)
    except PodSpecError as exc:
        raise BadRequest(f"pod {args.pod_label}: {exc}") from None


def filter_verb(body: Any, policy: ExtenderPolicy, state: ExtenderState) -> dict[str, Any]:
    """ExtenderFilterResult: the nodes that can hold the pod, and why the others cannot.

    Also the verdict code per node (for the metrics), under a key Go does not read."""
    args = read_args(body, state)
    need = _need(args, policy)
    if not need.wants_gpu:
        if args.names is not None:
            return {"Nodes": None, "NodeNames": args.names, "FailedNodes": {}, "Error": ""}
        return {"Nodes": {"items": args.nodes}, "NodeNames": None, "FailedNodes": {}, "Error": ""}
    # Scheduled again (its binding failed or it is being retried): it holds nothing now.
    state.ledger.forget_pod(args.pod_uid)
    state.pods.put(args.pod_uid, need)
    kept: list[Mapping[str, Any]] = []
    failed: dict[str, str] = {}
    question = _question(args, need, policy, state, exclude_pod="")
    codes: dict[str, int] = {}
    if args.names is not None:
        kept_names: list[str] = []
        for name in args.names:
            verdict, _judged = judge_name(name, question, policy, state)
            codes[verdict.code] = codes.get(verdict.code, 0) + 1
            if verdict.fit.placement is None:
                failed[name] = verdict.fit.reason
            else:
                kept_names.append(name)
        return {
            "Nodes": None,
            "NodeNames": kept_names,
            "FailedNodes": failed,
            "Error": "",
            VERDICTS_KEY: codes,
        }
    for node in args.nodes:
        verdict, _judged = judge_node(node, question, policy, state)
        codes[verdict.code] = codes.get(verdict.code, 0) + 1
        if verdict.fit.placement is None:
            failed[verdict.name] = verdict.fit.reason
        else:
            kept.append(node)
    return {
        "Nodes": {"items": kept},
        "NodeNames": None,
        "FailedNodes": failed,
        "Error": "",
        VERDICTS_KEY: codes,
    }


#: Key of the per-code node counts in the filter's answer; the HTTP layer removes it.
VERDICTS_KEY = "_verdicts"


def prioritize_verb(
    body: Any, policy: ExtenderPolicy, state: ExtenderState
) -> list[dict[str, Any]]:
    """HostPriorityList: 0..10 per node, binpack or spread over the card the pod would get.

    The pod's own hold (if it was bound before and is scheduled again) is left out of
    the state it is scored against."""
    args = read_args(body, state)
    need = _need(args, policy)
    question = _question(args, need, policy, state, exclude_pod=args.pod_uid)
    scores = []
    if args.names is not None:
        for name in args.names:
            verdict, judged = judge_name(name, question, policy, state)
            scores.append({"Host": name, "Score": _score(verdict, judged, policy)})
        return scores
    for node in args.nodes:
        verdict, judged = judge_node(node, question, policy, state)
        scores.append({"Host": verdict.name, "Score": _score(verdict, judged, policy)})
    return scores


def _score(verdict: NodeVerdict, judged: Judged | None, policy: ExtenderPolicy) -> int:
    """``score(verdict.fit)``, computed once per kept verdict."""
    if judged is None:
        return score(verdict.fit, policy.placement)
    if judged.score is None:
        judged.score = score(verdict.fit, policy.placement)
    return judged.score


def _question(
    args: ExtenderArgs,
    need: PodNeed,
    policy: ExtenderPolicy,
    state: ExtenderState,
    exclude_pod: str,
) -> Question:
    choice = card_choice_of(args.pod, policy.resource_prefix)
    return Question(need, choice, exclude_pod, state.verdicts.shape((need, choice)))


@dataclass(frozen=True)
class BindingArgs:
    """ExtenderBindingArgs: which pod (with its UID) goes to which node."""

    name: str
    namespace: str
    uid: str
    node: str
    #: container -> the card the extender planned for it (the daemon follows it)
    plan: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"


def _name_field(body: Mapping[str, Any], key: str) -> str:
    value = _get(body, key)
    if not isinstance(value, str) or not value or len(value) > 253:
        raise BadRequest(f"{key} must be a non-empty string of at most 253 characters")
    return value


def read_binding_args(body: Any) -> BindingArgs:
    if not isinstance(body, Mapping):
        raise BadRequest("the body must be a JSON object (ExtenderBindingArgs)")
    return BindingArgs(
        name=_name_field(body, "PodName"),
        namespace=_name_field(body, "PodNamespace"),
        uid=_name_field(body, "PodUID"),
        node=_name_field(body, "Node"),
    )


class BindRefused(Exception):
    """The pod cannot be bound there now; the scheduler is told and retries the pod."""


def bind_verb(body: Any, policy: ExtenderPolicy, state: ExtenderState) -> BindingArgs:
    """Check the pod still fits the chosen node, counting the pods bound before it, and
    record its hold there. The caller posts the Binding, with the planned card of each
    container (``plan``) as an annotation, and calls ``state.ledger.forget_pod`` if
    that fails.

    The plan matters when the kubelet admits pods bound close together in another order
    than they were bound (a kubelet restart admits them by creation time; bindings posted
    at once may land in any order): the daemon's placement would then see other free
    room than the extender did, and a pod that fits in bind order may find no single
    card. Following the plan, every admission order lands where the holds counted."""
    args = read_binding_args(body)
    need = state.pods.get(args.uid)
    if need is None:
        raise BindRefused(
            f"pod {args.label} was not filtered by this extender (or too long ago); "
            "it will be scheduled again"
        )
    published = state.nodes.get(args.node)
    if published is None:
        raise BindRefused(f"node {args.node} was not seen in a filter call")
    record = state.node_cache.get(args.node) if state.node_cache is not None else None
    if record is not None and record.state is not None:
        # the node watch may have seen a newer state since the filter
        published = newest(published, record.state)
        state.nodes.put(args.node, published)
    verdict = judge_state(args.node, published, need, policy, state.ledger, exclude_pod=args.uid)
    if verdict.fit.placement is None:
        raise BindRefused(
            f"node {args.node} no longer holds pod {args.label}: {verdict.fit.reason}"
        )
    state.ledger.record(
        args.uid,
        args.node,
        published.generation,
        verdict.fit.placement.use_by_card(),
        pod_key=args.label,
    )
    state.pods.pop(args.uid)
    plan = tuple((need.name, uuid) for uuid, need in verdict.fit.placement.cards)
    return replace(args, plan=plan)
