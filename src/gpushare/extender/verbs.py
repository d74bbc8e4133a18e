"""The filter and prioritize verbs over the scheduler's JSON, without HTTP.

kube-scheduler sends ExtenderArgs from Go types without JSON tags, so the keys arrive
capitalised (``Pod``, ``Nodes``, ``NodeNames``); Go reads answers case-insensitively.
With ``nodeCacheCapable: false`` the nodes arrive as full Node objects in
``Nodes.items``, and the filter must answer them the same way: a node dropped without
an entry in ``FailedNodes`` would vanish without a reason in the pod's events.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpushare import nodestate
from gpushare.extender.choice import card_choice_of, excluded_rooms
from gpushare.extender.fit import (
    BINPACK,
    Fit,
    PodNeed,
    PodSpecError,
    card_rooms,
    fit_pod,
    pod_need,
    score,
    subtract,
)
from gpushare.extender.ledger import AdmissionLedger
from gpushare.gputype import CardChoice


class BadRequest(ValueError):
    """The request cannot be answered; the message goes back with HTTP 400."""


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


def read_args(body: Any) -> ExtenderArgs:
    """Validate an ExtenderArgs body; every mistake is a :class:`BadRequest`."""
    if not isinstance(body, Mapping):
        raise BadRequest("the body must be a JSON object with Pod and Nodes (ExtenderArgs)")
    pod = _get(body, "Pod")
    if not isinstance(pod, Mapping):
        raise BadRequest("Pod is missing or not an object")
    nodes = _get(body, "Nodes")
    if nodes is None:
        if _get(body, "NodeNames") is not None:
            raise BadRequest(
                "got NodeNames only: this extender reads the node state from full Node "
                "objects, so configure it with nodeCacheCapable: false"
            )
        raise BadRequest("Nodes is missing")
    if not isinstance(nodes, Mapping):
        raise BadRequest("Nodes must be an object with items (a NodeList)")
    items = _get(nodes, "items")
    if items is None:
        items = []
    if not isinstance(items, list):
        raise BadRequest("Nodes.items must be a list of Node objects")
    for position, node in enumerate(items):
        if not isinstance(node, Mapping) or not _node_name(node):
            raise BadRequest(f"Nodes.items[{position}] is not a Node with metadata.name")
    meta = pod.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise BadRequest("Pod.metadata must be an object")
    name = f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"
    uid = str(meta.get("uid") or "") or name
    return ExtenderArgs(pod=pod, pod_uid=uid, pod_label=name, nodes=list(items))


def _node_name(node: Mapping[str, Any]) -> str:
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


def _has_resource(node: Mapping[str, Any], resource: str) -> bool:
    status = node.get("status")
    if not isinstance(status, Mapping):
        return False
    for key in ("allocatable", "capacity"):
        amounts = status.get(key)
        if isinstance(amounts, Mapping) and str(amounts.get(resource, "0")) not in ("0", ""):
            return True
    return False


@dataclass(frozen=True)
class NodeVerdict:
    name: str
    fit: Fit
    generation: int | None


def judge_node(
    node: Mapping[str, Any],
    need: PodNeed,
    policy: ExtenderPolicy,
    ledger: AdmissionLedger,
    exclude_pod: str = "",
    choice: CardChoice | None = None,
) -> NodeVerdict:
    """Read one Node's published cards, take off what the ledger holds and the cards the
    pod's annotations exclude (``choice``), and fit the pod."""
    name = _node_name(node)
    prefix = policy.resource_prefix
    key = nodestate.annotation_key(prefix)
    meta = node.get("metadata") or {}
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    text = annotations.get(key) if isinstance(annotations, Mapping) else None
    if text is None:
        if _has_resource(node, f"{prefix}/vcuda-memory") or _has_resource(
            node, f"{prefix}/vcuda-core"
        ):
            reason = (
                f"the node has gpushare resources but no {key} annotation, so its cards are "
                "unknown (is the gpushare daemon running there with NODE_NAME set?)"
            )
        else:
            reason = "the node has no gpushare GPUs"
        return NodeVerdict(name, Fit(None, reason), None)
    try:
        state = nodestate.decode(str(text))
    except ValueError as exc:
        return NodeVerdict(name, Fit(None, f"the {key} annotation cannot be read: {exc}"), None)
    held = ledger.pending_use(name, state.generation, exclude_pod)
    rooms, excluded = excluded_rooms(subtract(card_rooms(state), held), state, choice)
    if excluded and len(excluded) == len(rooms):
        reason = f"the pod's card choice excludes every card: {', '.join(excluded)}"
        return NodeVerdict(name, Fit(None, reason), None)
    fit = fit_pod(rooms, need, policy.placement)
    if not fit.fits and excluded:
        fit = Fit(None, f"{fit.reason} (excluded by the pod's card choice: {', '.join(excluded)})")
    if not fit.fits and held:
        pending = ledger.pending_pods(name, exclude_pod)
        fit = Fit(
            None,
            f"{fit.reason} (counting {pending} pod(s) admitted here that the node's "
            "annotation does not show yet)",
        )
    return NodeVerdict(name, fit, state.generation)


def _need(args: ExtenderArgs, policy: ExtenderPolicy) -> PodNeed:
    try:
        return pod_need(args.pod, policy.resource_prefix)
    except PodSpecError as exc:
        raise BadRequest(f"pod {args.pod_label}: {exc}") from None


def filter_verb(body: Any, policy: ExtenderPolicy, ledger: AdmissionLedger) -> dict[str, Any]:
    """ExtenderFilterResult: the nodes that can hold the pod, and why the others cannot."""
    args = read_args(body)
    need = _need(args, policy)
    if not need.wants_gpu:
        return {"Nodes": {"items": args.nodes}, "NodeNames": None, "FailedNodes": {}, "Error": ""}
    ledger.forget_pod(args.pod_uid)
    kept: list[Mapping[str, Any]] = []
    failed: dict[str, str] = {}
    choice = card_choice_of(args.pod, policy.resource_prefix)
    for node in args.nodes:
        verdict = judge_node(node, need, policy, ledger, choice=choice)
        if verdict.fit.placement is None:
            failed[verdict.name] = verdict.fit.reason
            continue
        kept.append(node)
        assert verdict.generation is not None
        ledger.record(
            args.pod_uid, verdict.name, verdict.generation, verdict.fit.placement.use_by_card()
        )
    return {"Nodes": {"items": kept}, "NodeNames": None, "FailedNodes": failed, "Error": ""}


def prioritize_verb(
    body: Any, policy: ExtenderPolicy, ledger: AdmissionLedger
) -> list[dict[str, Any]]:
    """HostPriorityList: 0..10 per node, binpack or spread over the card the pod would get.

    The pod's own ledger entries (from its filter call) are left out of the state it is
    scored against, so a node is not scored as if the pod were already there twice.
    """
    args = read_args(body)
    need = _need(args, policy)
    scores = []
    choice = card_choice_of(args.pod, policy.resource_prefix)
    for node in args.nodes:
        verdict = judge_node(node, need, policy, ledger, exclude_pod=args.pod_uid, choice=choice)
        scores.append({"Host": verdict.name, "Score": score(verdict.fit, policy.placement)})
    return scores
