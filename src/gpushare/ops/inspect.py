"""``kubectl gpushare inspect [NODE] [-d] [-o json]``: who uses which card, from annotations.

Everything comes from the places the daemon writes: the node's state object (ConfigMap
``gpushare-node-<node>``, see ``stateobject.py``; believed when it names and is owned by
that Node, and there is one per node) or else the Node annotation ``<prefix>/gpus``
(per-card state, see ``nodestate.py``; older daemons, or ``--node-state annotation``),
and the Pod annotations
``<prefix>/gpu.<container>`` (the card each container got), plus the pods' own
resource requests. Cards served by the DRA driver (card mode ``dra``) are shown from the
same Node annotation: the claims prepared on each, their memory and cores.
Reading the cluster is :func:`fetch`; turning plain Node and Pod
objects into a view is :func:`build_view`; :func:`render_table` and :func:`render_json`
are pure functions of that view.

Pod annotations can be written by whoever may edit the pod, so they are believed only
as far as the daemon's own Node annotation backs them: the pod is on that node, the
annotation names one of its cards and a container of the pod that asks for gpushare
resources, the daemon's own list of the pods on that card (``pods``, from the kubelet's
records) names the pod with at least the units its containers there ask, and the
containers listed on a card add up to no more than the daemon counts there (otherwise
the card's list is withheld and says so). A pod whose annotation names a card the
daemon does not list it on is not shown there (issue 32.16), only counted as
unbacked. Every string is
printed through :func:`gpushare.ops.printable.printable`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import yaml

from gpushare.base.cli import Parser
from gpushare.config import Settings
from gpushare.extender.fit import PodSpecError, container_need
from gpushare.kube import nodestate, stateobject
from gpushare.kube.kubectlapi import EXIT_NO_CLUSTER, ApiError, Cluster, NoCluster
from gpushare.ops.printable import printable

TERMINAL_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True)
class ContainerOnCard:
    namespace: str
    pod: str
    container: str
    memory_units: int
    core_units: int
    #: the keys the daemon may list the pod under: its UID, and ``namespace/name``
    pod_keys: tuple[str, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class InspectedCard:
    card: nodestate.CardState
    containers: tuple[ContainerOnCard, ...]
    #: the pods' annotations claim more than the daemon counts on the card: not listed
    disputed: bool = False
    #: containers whose pod annotation names this card but whose pod the daemon's own
    #: list for the card does not back: not listed (a claim, not a fact)
    unbacked: int = 0


def _backed(
    card: nodestate.CardState, claimed: Sequence[ContainerOnCard]
) -> tuple[list[ContainerOnCard], int]:
    """The claimed containers the daemon's per-card pod list backs: the pod is listed
    there and its containers claiming the card ask no more than the daemon counts for it.
    With no list (an older daemon) every claim passes; with a truncated list, a pod the
    list leaves out is kept (the card's total still bounds it)."""
    if card.pods is None:
        return list(claimed), 0
    held = {key: (memory, core) for key, memory, core in card.pods}
    by_pod: dict[tuple[str, str], list[ContainerOnCard]] = {}
    for c in claimed:
        by_pod.setdefault((c.namespace, c.pod), []).append(c)
    kept: list[ContainerOnCard] = []
    unbacked = 0
    for containers in by_pod.values():
        units = next((held[k] for k in containers[0].pod_keys if k in held), None)
        if units is None:
            if card.pods_truncated:
                kept += containers
            else:
                unbacked += len(containers)
            continue
        memory = sum(c.memory_units for c in containers)
        core = sum(c.core_units for c in containers)
        if memory > units[0] or core > units[1]:
            unbacked += len(containers)
        else:
            kept += containers
    return kept, unbacked


def _inspected_card(card: nodestate.CardState, claimed: Sequence[ContainerOnCard]) -> InspectedCard:
    kept, unbacked = _backed(card, claimed)
    memory = sum(c.memory_units for c in kept)
    core = sum(c.core_units for c in kept)
    if memory > card.memory_units_used or core > card.core_units_used:
        return InspectedCard(card, (), disputed=True, unbacked=unbacked)
    return InspectedCard(card, tuple(kept), unbacked=unbacked)


@dataclass(frozen=True)
class NodeView:
    name: str
    memory_unit_mib: int
    generation: int | None
    updated: str
    cards: tuple[InspectedCard, ...]
    problem: str = ""
    #: cards not offered as shared units (whole-only, MIG with its devices)
    whole: tuple[nodestate.WholeCardState, ...] = ()
    #: the daemon never published on this opted-in node (``problem`` says so)
    unreported: bool = False
    #: each card's enforcement backends (absent from an older daemon's annotation)
    enforcement: tuple[nodestate.CardEnforcement, ...] = ()

    @property
    def card_count(self) -> int:
        """Physical cards, as the node's ``gpu.count`` label counts them (a MIG device
        sliced into units is listed as a card of its own but is part of its card)."""
        return sum(1 for c in self.cards if not c.card.uuid.startswith("MIG-")) + len(
            self.whole
        )


#: Said of an opted-in node whose daemon has not published its cards.
NO_REPORT = "no daemon report"


def card_health(card: nodestate.CardState) -> str:
    """What the HEALTH column says of a shared card: its own health first, then whether
    it is held whole (its units are then offered as unhealthy, but the card is fine)."""
    own = card.healthy if card.hardware_healthy is None else card.hardware_healthy
    if not own:
        return "UNHEALTHY"
    if card.held_by:
        return f"held whole by {card.held_by}"
    return "healthy"


def is_dra(card: nodestate.WholeCardState) -> bool:
    return card.mode == nodestate.DRA_MODE


def whole_health(healthy: bool, held_by: str) -> str:
    if not healthy:
        return "UNHEALTHY"
    return f"held by {held_by}" if held_by else "free"


@dataclass(frozen=True)
class ClusterView:
    nodes: tuple[NodeView, ...]


# -- plain objects -> view ---------------------------------------------------------


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _has_gpushare_resources(node: Mapping[str, Any], prefix: str) -> bool:
    status = node.get("status") if isinstance(node.get("status"), Mapping) else {}
    assert isinstance(status, Mapping)
    allocatable = status.get("allocatable") or status.get("capacity") or {}
    return any(
        str(allocatable.get(f"{prefix}/{name}", "0")) not in ("0", "")
        for name in ("vcuda-memory", "vcuda-core")
    )


def _containers_by_card(
    pods: Sequence[Mapping[str, Any]], prefix: str
) -> dict[tuple[str, str], list[ContainerOnCard]]:
    """(node name, card UUID) -> the containers annotated as running there."""
    marker = nodestate.pod_annotation_key(prefix, "")
    found: dict[tuple[str, str], list[ContainerOnCard]] = {}
    for pod in pods:
        meta = _meta(pod)
        status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
        if (status or {}).get("phase") in TERMINAL_PHASES:
            continue
        spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
        assert isinstance(spec, Mapping)
        node_name = str(spec.get("nodeName") or "")
        if not node_name:  # not on a node: on no card
            continue
        specs = {
            str(c.get("name")): c
            for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
            if isinstance(c, Mapping)
        }
        annotations = meta.get("annotations")
        annotations = annotations if isinstance(annotations, Mapping) else {}
        named = {nodestate.pod_annotation_key(prefix, name): name for name in specs}
        namespace = str(meta.get("namespace") or "default")
        keys = (str(meta.get("uid") or ""), f"{namespace}/{meta.get('name')}")
        for key, uuid in sorted(annotations.items()):
            name = named.get(key) if isinstance(key, str) and key.startswith(marker) else None
            if name is None:  # not the daemon's key for a container of this pod
                continue
            try:
                need = container_need(specs[name], prefix)
            except PodSpecError:
                continue
            memory, core = need.memory_units, need.core_units
            if not memory and not core:  # asks for no gpushare resource: on no card
                continue
            found.setdefault((node_name, str(uuid)), []).append(
                ContainerOnCard(
                    namespace,
                    str(meta.get("name")),
                    name,
                    memory,
                    core,
                    tuple(k for k in keys if k),
                )
            )
    return found


def state_texts(
    nodes: Sequence[Mapping[str, Any]], objects: Sequence[Mapping[str, Any]], prefix: str
) -> dict[str, str]:
    """node name -> the card state its state object holds, for the objects believed: one
    per node, self-consistent and owned by that Node's UID (two for one node, as a
    second installation or a forgery would make: neither)."""
    uids = {str(_meta(n).get("name", "")): str(_meta(n).get("uid") or "") for n in nodes}
    found: dict[str, list[str]] = {}
    for obj in objects:
        read = stateobject.read_state_object(obj, prefix)
        uid = uids.get(read.node)
        if read.text is None or not uid or read.owner_uid != uid:
            continue
        found.setdefault(read.node, []).append(read.text)
    return {node: texts[0] for node, texts in found.items() if len(texts) == 1}


def _newer_text(held: str | None, annotation: Any) -> Any:
    """The state object's text, unless the Node's annotation decodes to a newer state (an
    object left behind by a daemon switched to ``--node-state annotation``)."""
    if held is None or not isinstance(annotation, str):
        return annotation if held is None else held
    try:
        newer = nodestate.recency(nodestate.decode(annotation)) > nodestate.recency(
            nodestate.decode(held)
        )
    except ValueError:
        return held
    return annotation if newer else held


def build_view(
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    prefix: str,
    namespace: str | None = None,
    objects: Sequence[Mapping[str, Any]] = (),
) -> ClusterView:
    """The gpushare nodes (those with a state object, the annotation or the resources),
    sorted by name; a node's state object (``objects``: the listed ConfigMaps
    ``gpushare-node-<node>``, see :func:`state_texts`) wins over its annotation unless
    the annotation is the newer (:func:`_newer_text`), as the extender judges. With
    ``namespace``, the DRA claims of that namespace only are listed (the pods are
    filtered by the caller; cards and totals stay whole)."""
    by_card = _containers_by_card(pods, prefix)
    key = nodestate.annotation_key(prefix)
    published = state_texts(nodes, objects, prefix)
    views = []
    for node in nodes:
        name = str(_meta(node).get("name", ""))
        annotation = (_meta(node).get("annotations") or {}).get(key)
        text = _newer_text(published.get(name), annotation)
        if text is None:
            if _has_gpushare_resources(node, prefix) or _opted_in(node, prefix):
                problem = f"{NO_REPORT}: no state object, no {key} annotation (daemon down?)"
                views.append(NodeView(name, 0, None, "", (), problem, unreported=True))
            continue
        try:
            state = nodestate.decode(str(text))
        except ValueError as exc:
            views.append(NodeView(name, 0, None, "", (), f"unreadable {key} annotation: {exc}"))
            continue
        cards = tuple(
            _inspected_card(card, by_card.get((name, card.uuid), ()))
            for card in sorted(state.cards, key=lambda c: c.index)
        )
        views.append(
            NodeView(
                name,
                state.memory_unit_mib,
                state.generation,
                state.updated,
                cards,
                whole=tuple(
                    _claims_of(card, namespace)
                    for card in sorted(state.whole, key=lambda c: c.index)
                ),
                enforcement=state.enforcement,
            )
        )
    return ClusterView(tuple(sorted(views, key=lambda v: v.name)))


def _claims_of(
    card: nodestate.WholeCardState, namespace: str | None
) -> nodestate.WholeCardState:
    if not namespace or not card.claims:
        return card
    return replace(card, claims=tuple(c for c in card.claims if c.namespace == namespace))


def _opted_in(node: Mapping[str, Any], prefix: str) -> bool:
    """The node carries the opt-in label (``<prefix>/enabled=true``, what ``install``
    and the chart put on a node for the DaemonSet to run there)."""
    labels = _meta(node).get("labels")
    return isinstance(labels, Mapping) and labels.get(f"{prefix}/{OPT_IN_NAME}") == "true"


#: The name part of the opt-in label (``gpushare.io/enabled``).
OPT_IN_NAME = "enabled"


# -- view -> text --------------------------------------------------------------------


def _count(number: int, noun: str) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _percent(used: int, total: int) -> str:
    return f"{100 * used / total:.1f} %" if total else "-"


@dataclass(frozen=True)
class Totals:
    nodes: int
    cards: int
    healthy_cards: int
    memory_mib: int
    memory_used_mib: int
    core_units: int
    core_units_used: int
    unreported_nodes: int = 0
    held_whole: int = 0


def _own_health(card: nodestate.CardState) -> bool:
    return card.healthy if card.hardware_healthy is None else card.hardware_healthy


def totals(view: ClusterView) -> Totals:
    cards = [(n, c.card) for n in view.nodes for c in n.cards]
    physical = [c for _, c in cards if not c.uuid.startswith("MIG-")]
    whole = [w for n in view.nodes for w in n.whole]
    dra = [(n.memory_unit_mib, w) for n in view.nodes for w in n.whole if is_dra(w)]
    return Totals(
        nodes=len(view.nodes),
        unreported_nodes=sum(1 for n in view.nodes if n.unreported),
        cards=len(physical) + len(whole),
        held_whole=sum(1 for c in physical if c.held_by)
        + sum(1 for w in whole if w.held_by or any(d.held_by for d in w.mig)),
        healthy_cards=sum(1 for c in physical if _own_health(c))
        + sum(1 for w in whole if w.healthy),
        memory_mib=sum(c.memory_units * n.memory_unit_mib for n, c in cards)
        + sum(w.dra_memory_total(unit) for unit, w in dra),
        memory_used_mib=sum(c.memory_units_used * n.memory_unit_mib for n, c in cards)
        + sum(w.memory_used_mib for _, w in dra),
        core_units=sum(c.core_units for _, c in cards) + sum(w.dra_cores_total() for _, w in dra),
        core_units_used=sum(c.core_units_used for _, c in cards)
        + sum(w.cores_used for _, w in dra),
    )




def _align(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]


def render_table(view: ClusterView, details: bool = False, wide: bool = False) -> str:
    """The human-readable report: one block per node, cluster totals at the bottom;
    ``wide`` adds each card's UUID (``-o wide``)."""
    lines: list[str] = []
    for node in view.nodes:
        lines += _node_lines(node, details, wide)
    lines += _cluster_lines(totals(view))
    return "\n".join(lines) + "\n"


def _node_lines(node: NodeView, details: bool, wide: bool) -> list[str]:
    """A node's block: its heading, a row per card in index order, its enforcement."""
    if node.problem:
        return [f"NODE {printable(node.name)}: {printable(node.problem, 400)}", ""]
    unit = node.memory_unit_mib
    lines = [
        f"NODE {printable(node.name)}  ({_count(node.card_count, 'card')}, {unit} MiB units, "
        f"generation {node.generation}, updated {printable(node.updated, 40)})"
    ]
    rows: list[list[str]] = [["GPU", "NAME", "MEMORY MiB", "", "UNITS", "CORES", "HEALTH"]]
    if wide:
        rows[0].append("UUID")
    entries: list[tuple[int, int, InspectedCard | nodestate.WholeCardState]] = [
        (c.card.index, 0, c) for c in node.cards
    ] + [(w.index, 1, w) for w in node.whole]
    for _index, _kind, entry in sorted(entries, key=lambda e: (e[0], e[1])):
        if isinstance(entry, nodestate.WholeCardState):
            if is_dra(entry):
                rows += _dra_rows(entry, unit, details, wide)
            else:
                rows += _whole_rows(entry, wide)
            continue
        rows += _shared_rows(entry, unit, details, wide)
    lines += ["  " + row for row in _align(rows)]
    lines += enforcement_lines(node.enforcement, details)
    lines.append("")
    return lines


def _shared_rows(
    view_card: InspectedCard, unit: int, details: bool, wide: bool
) -> list[list[str]]:
    """A shared card's row; with ``details``, why containers are not listed and a row
    per container listed."""
    card = view_card.card
    rows = [
        [
            str(card.index),
            printable(card.name, 64),
            f"{card.memory_units_used * unit}/{card.memory_units * unit}",
            f"({_percent(card.memory_units_used, card.memory_units)})",
            f"{card.memory_units_used}/{card.memory_units}",
            f"{card.core_units_used}/{card.core_units}",
            printable(card_health(card), 200),
            *([printable(card.uuid)] if wide else []),
        ]
    ]
    if details and view_card.disputed:
        rows.append(["", "  (not listed: pod annotations claim more than the daemon counts)"])
    if details and view_card.unbacked:
        rows.append(
            [
                "",
                f"  (not listed: {_count(view_card.unbacked, 'container')} whose pod "
                "annotation names this card, not backed by the daemon's pod list)",
            ]
        )
    if details:
        for c in view_card.containers:
            rows.append(
                [
                    "",
                    "  " + "/".join(map(printable, (c.namespace, c.pod, c.container))),
                    f"{c.memory_units * unit}",
                    "",
                    f"{c.memory_units}",
                    f"{c.core_units}",
                ]
            )
    return rows


def _cluster_lines(total: Totals) -> list[str]:
    reporting = (
        f" ({total.nodes - total.unreported_nodes} reporting, "
        f"{total.unreported_nodes} {NO_REPORT})"
        if total.unreported_nodes
        else ""
    )
    held = f", {total.held_whole} held whole" if total.held_whole else ""
    return [
        f"CLUSTER  {_count(total.nodes, 'node')}{reporting}, {_count(total.cards, 'card')} "
        f"({total.healthy_cards} healthy{held})",
        f"  memory  {total.memory_used_mib}/{total.memory_mib} MiB "
        f"({_percent(total.memory_used_mib, total.memory_mib)})",
        f"  cores   {total.core_units_used}/{total.core_units} "
        f"({_percent(total.core_units_used, total.core_units)})",
    ]


def enforcement_lines(
    enforcement: Sequence[nodestate.CardEnforcement], details: bool
) -> list[str]:
    """``ENFORCED BY  memory: driver 0,1  interposer 2   compute: interposer 0,1,2``;
    with ``details`` each card's reason for its memory backend."""
    if not enforcement:
        return []
    parts = []
    for kind in ("memory", "compute"):
        by_backend: dict[str, list[str]] = {}
        for card in enforcement:
            by_backend.setdefault(getattr(card, kind), []).append(str(card.index))
        listed = "  ".join(
            f"{printable(b, 16)} {','.join(cards)}" for b, cards in sorted(by_backend.items())
        )
        parts.append(f"{kind}: {listed}")
    lines = ["  ENFORCED BY  " + "   ".join(parts)]
    if details:
        lines += [
            f"    GPU {card.index}: memory {printable(card.memory, 16)} "
            f"({printable(card.why, 200)})"
            for card in enforcement
        ]
    return lines


def _whole_rows(card: nodestate.WholeCardState, wide: bool) -> list[list[str]]:
    """A card not offered as shared units, and its MIG devices under it."""
    kind = "MIG" if card.mig else "whole"
    health = whole_health(card.healthy, card.held_by)
    if card.mode == nodestate.TIMESLICE_MODE:
        kind = f"time-sliced x{card.replicas}"
        health = f"{card.replicas_held}/{card.replicas} replicas; {health}"
    rows = [
        [
            str(card.index),
            printable(card.name, 64),
            f"{card.memory_mib} ({kind})",
            "",
            "-",
            "-",
            printable(health, 300),
            *([printable(card.uuid)] if wide else []),
        ]
    ]
    for device in card.mig:
        rows.append(
            [
                "",
                f"  MIG {printable(device.profile, 32)}",
                "",
                "",
                "",
                "",
                printable(whole_health(device.healthy, device.held_by), 200),
                *([printable(device.uuid)] if wide else []),
            ]
        )
    return rows


def _size(value: int | None) -> str:
    return "?" if value is None else str(value)


def _dra_rows(
    card: nodestate.WholeCardState, unit_mib: int, details: bool, wide: bool
) -> list[list[str]]:
    """A card served by the DRA driver; with ``details`` one line per claim's device."""
    total = card.dra_memory_total(unit_mib)
    rows = [
        [
            str(card.index),
            printable(card.name, 64),
            f"{card.memory_used_mib}/{total}",
            f"({_percent(card.memory_used_mib, total)})",
            "DRA",
            f"{card.cores_used}/{card.dra_cores_total()}",
            "healthy" if card.healthy else "UNHEALTHY",
            *([printable(card.uuid)] if wide else []),
        ]
    ]
    if not details:
        return rows
    own = f"gpu-{card.index}"
    for claim in card.claims:
        name = "/".join(map(printable, (claim.namespace, claim.claim)))
        where = "" if claim.device == own else f" on {printable(claim.device, 63)}"
        request = f" ({printable(claim.request, 127)})" if claim.request else ""
        rows.append(
            ["", f"  claim {name}{request}{where}", _size(claim.memory_mib), "", "",
             _size(claim.cores)]
        )  # fmt: skip
    if card.claims_truncated:
        rows.append(["", f"  ({card.claim_count} claims, {len(card.claims)} listed)"])
    return rows


def _replica_data(card: nodestate.WholeCardState) -> dict[str, Any]:
    """The time-slicing figures of a card's JSON/YAML entry."""
    return {"mode": card.mode, "replicas": card.replicas, "replicas_held": card.replicas_held}


def _dra_data(card: nodestate.WholeCardState, unit_mib: int) -> dict[str, Any]:
    """The DRA figures of a card's JSON/YAML entry."""
    return {
        "mode": card.mode,
        "memory_total_mib": card.dra_memory_total(unit_mib),
        "memory_used_mib": card.memory_used_mib,
        "core_units": card.dra_cores_total(),
        "core_units_used": card.cores_used,
        "claim_count": card.claim_count,
        "claims_truncated": card.claims_truncated,
        "claims": [
            {
                "namespace": c.namespace,
                "claim": c.claim,
                "request": c.request,
                "device": c.device,
                "memory_mib": c.memory_mib,
                "cores": c.cores,
            }
            for c in card.claims
        ],
    }


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _camel_keys(value: Any) -> Any:
    """One key style for JSON and YAML output, kubectl's: ``memoryUnitsUsed``."""
    if isinstance(value, dict):
        return {_camel(str(k)): _camel_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_camel_keys(v) for v in value]
    return value


def view_data(view: ClusterView) -> dict[str, Any]:
    """The view as plain data with camelCase keys (containers always included)."""
    nodes = [_node_data(node) for node in view.nodes]
    data: dict[str, Any] = _camel_keys({"nodes": nodes, "totals": _totals_data(totals(view))})
    return data


def _node_data(node: NodeView) -> dict[str, Any]:
    unit = node.memory_unit_mib
    return {
        "name": node.name,
        "memory_unit_mib": unit or None,
        "generation": node.generation,
        "updated": node.updated or None,
        "problem": node.problem or None,
        "card_count": node.card_count,
        **({"enforcement": [asdict(e) for e in node.enforcement]} if node.enforcement else {}),
        "gpus": [_shared_card_data(c, unit) for c in node.cards],
        "whole_gpus": [_whole_card_data(w, unit) for w in node.whole],
    }


def _shared_card_data(c: InspectedCard, unit: int) -> dict[str, Any]:
    """A card whose units are shared, with the containers on it."""
    return {
        "index": c.card.index,
        "uuid": c.card.uuid,
        "name": c.card.name,
        "healthy": _own_health(c.card),
        "offered": c.card.healthy,
        "held_by": c.card.held_by or None,
        "memory_mib": c.card.memory_mib,
        "memory_units": c.card.memory_units,
        "memory_units_used": c.card.memory_units_used,
        "memory_total_mib": c.card.memory_units * unit,
        "memory_used_mib": c.card.memory_units_used * unit,
        "core_units": c.card.core_units,
        "core_units_used": c.card.core_units_used,
        **({"containers_disputed": True} if c.disputed else {}),
        **({"containers_unbacked": c.unbacked} if c.unbacked else {}),
        "containers": [
            {
                "namespace": x.namespace,
                "pod": x.pod,
                "container": x.container,
                "memory_units": x.memory_units,
                "memory_mib": x.memory_units * unit,
                "core_units": x.core_units,
            }
            for x in c.containers
        ],
    }


def _whole_card_data(w: nodestate.WholeCardState, unit: int) -> dict[str, Any]:
    """A card not shared by units: whole, in MIG mode, time-sliced or DRA's."""
    return {
        "index": w.index,
        "uuid": w.uuid,
        "name": w.name,
        "healthy": w.healthy,
        "memory_mib": w.memory_mib,
        "held_by": w.held_by or None,
        "mig": [
            {
                "uuid": d.uuid,
                "profile": d.profile,
                "resource": d.resource,
                "healthy": d.healthy,
                "held_by": d.held_by or None,
            }
            for d in w.mig
        ],
        **(_dra_data(w, unit) if is_dra(w) else {}),
        **(_replica_data(w) if w.mode == nodestate.TIMESLICE_MODE else {}),
    }


def _totals_data(t: Totals) -> dict[str, Any]:
    return {
        "nodes": t.nodes,
        "unreported_nodes": t.unreported_nodes,
        "cards": t.cards,
        "healthy_cards": t.healthy_cards,
        "held_whole": t.held_whole,
        "memory_mib": t.memory_mib,
        "memory_used_mib": t.memory_used_mib,
        "memory_percent": round(100 * t.memory_used_mib / t.memory_mib, 1) if t.memory_mib else 0,
        "core_units": t.core_units,
        "core_units_used": t.core_units_used,
        "core_percent": round(100 * t.core_units_used / t.core_units, 1) if t.core_units else 0,
    }


def render_json(view: ClusterView) -> str:
    """The view as JSON (``-o json``)."""
    return json.dumps(view_data(view), indent=2) + "\n"


def render_yaml(view: ClusterView) -> str:
    """The view as YAML (``-o yaml``)."""
    return str(yaml.safe_dump(view_data(view), sort_keys=False))


# -- the cluster ---------------------------------------------------------------------


class NodeNotFound(Exception):
    pass


def fetch(
    node_name: str | None, cluster: Cluster | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Nodes and pods as plain JSON objects, from the kubeconfig (or in-cluster)."""
    cluster = cluster or Cluster()
    if node_name:
        node = cluster.node(node_name)
        if node is None:
            raise NodeNotFound(node_name)
        return [node], cluster.pods(field_selector=f"spec.nodeName={node_name}")
    return cluster.nodes(), cluster.pods()


def fetch_state_objects(cluster: Cluster, prefix: str) -> list[dict[str, Any]]:
    """The nodes' state objects of every namespace (label ``<prefix>/node-state``);
    none when the caller may not list ConfigMaps (the annotations are read then)."""
    try:
        return cluster.configmaps(stateobject.selector(prefix))
    except ApiError:
        return []


OUTPUTS = ("table", "wide", "json", "yaml")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kubectl gpushare inspect",
        description="Per-card GPU memory and core use of gpushare nodes, from their state "
        "objects (ConfigMaps gpushare-node-<node>) or Node annotations.",
    )
    parser.add_argument("node", nargs="?", help="only this node")
    parser.add_argument(
        "-d", "--details", action="store_true", help="list the pods and containers on each card"
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=OUTPUTS,
        default="table",
        help="table, wide (the table with containers and card UUIDs), json or yaml",
    )
    parser.add_argument(
        "-n",
        "--namespace",
        metavar="NS",
        help="only list the containers and DRA claims of this namespace "
        "(cards and totals stay whole)",
    )
    parser.add_argument(
        "--resource-prefix",
        default=os.environ.get("GPUSHARE_RESOURCE_PREFIX", Settings().resource_prefix),
        help="prefix of gpushare's resources and annotations",
    )
    add_cluster_flags(parser)
    return parser


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """kubectl's --kubeconfig and --context (also accepted before the subcommand)."""
    parser.add_argument("--kubeconfig", metavar="FILE", help="the kubeconfig file to use")
    parser.add_argument("--context", metavar="NAME", help="the kubeconfig context to use")


def _in_namespace(pods: list[dict[str, Any]], namespace: str | None) -> list[dict[str, Any]]:
    if not namespace:
        return pods
    return [pod for pod in pods if (_meta(pod).get("namespace") or "default") == namespace]


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        cluster = Cluster(args.kubeconfig, args.context)
        nodes, pods = fetch(args.node, cluster)
        objects = fetch_state_objects(cluster, args.resource_prefix)
    except NoCluster as exc:
        print(f"kubectl gpushare inspect: {exc}".replace("\n", " "), file=sys.stderr)
        return EXIT_NO_CLUSTER
    except NodeNotFound:
        print(f"kubectl gpushare inspect: node {args.node!r} not found", file=sys.stderr)
        return 1
    except ApiError as exc:
        print(f"kubectl gpushare inspect: the API server answered {exc}", file=sys.stderr)
        return 1
    view = build_view(
        nodes, _in_namespace(pods, args.namespace), args.resource_prefix, args.namespace, objects
    )
    if args.node and not view.nodes:
        print(f"kubectl gpushare inspect: node {args.node!r} has no gpushare GPUs", file=sys.stderr)
        return 1
    if args.output == "json":
        sys.stdout.write(render_json(view))
    elif args.output == "yaml":
        sys.stdout.write(render_yaml(view))
    else:
        wide = args.output == "wide"
        sys.stdout.write(render_table(view, details=args.details or wide, wide=wide))
    return 0
