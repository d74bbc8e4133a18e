"""What the extender knows of each node's cards, by name, from its own watch of Nodes.

With ``nodeCacheCapable: true`` kube-scheduler sends only node names; the extender
answers from this cache, which :mod:`gpushare.extender.nodefeed` keeps from a
list-and-watch of the Nodes. Of each Node only what the verbs read is kept: its
published card state (decoded once, when it changes, not once per request) or why
there is none (:class:`NodeRecord`). The cost of a filter is then the fitting alone,
and a request is a list of names (about 20 bytes a node), so no cluster size reaches
the body limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpushare.extender.fit import CardRoom, card_rooms
from gpushare.kube import nodestate


@dataclass(frozen=True)
class NodeRecord:
    """One node as the verbs need it: its published cards, or ``code``/``reason``."""

    state: nodestate.NodeGpuState | None
    code: str = "fits"
    reason: str = ""
    #: ``card_rooms(state)``, computed once per published state
    rooms: tuple[CardRoom, ...] = ()


@dataclass
class NodeCache:
    """node name -> :class:`NodeRecord`; ``listed`` once the first list is read.

    Written only on the extender's event loop (by the node feed), read by the verbs."""

    records: dict[str, NodeRecord] = field(default_factory=dict)
    listed: bool = False

    def __len__(self) -> int:
        return len(self.records)

    def get(self, name: str) -> NodeRecord | None:
        return self.records.get(name)

    def replace_all(self, records: dict[str, NodeRecord]) -> None:
        self.records = records
        self.listed = True

    def put(self, name: str, record: NodeRecord) -> None:
        self.records[name] = record

    def drop(self, name: str) -> None:
        self.records.pop(name, None)


def _has_resource(node: Mapping[str, Any], resource: str) -> bool:
    status = node.get("status")
    if not isinstance(status, Mapping):
        return False
    for key in ("allocatable", "capacity"):
        amounts = status.get(key)
        if isinstance(amounts, Mapping) and str(amounts.get(resource, "0")) not in ("0", ""):
            return True
    return False


def read_node_state(
    node: Mapping[str, Any], prefix: str
) -> tuple[nodestate.NodeGpuState | None, str, str]:
    """(state, code, reason): the node's published cards, or why there are none."""
    key = nodestate.annotation_key(prefix)
    meta = node.get("metadata") or {}
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    text = annotations.get(key) if isinstance(annotations, Mapping) else None
    if not isinstance(text, str):
        if _has_resource(node, f"{prefix}/vcuda-memory") or _has_resource(
            node, f"{prefix}/vcuda-core"
        ):
            return (
                None,
                "no_annotation",
                (
                    f"the node has gpushare resources but no {key} annotation, so its cards are "
                    "unknown (is the gpushare daemon running there with NODE_NAME set?)"
                ),
            )
        return None, "no_gpus", "the node has no gpushare GPUs"
    try:
        state = nodestate.decode(text)
        card_rooms(state)  # its counts are believable
    except (ValueError, RecursionError) as exc:
        return None, "bad_annotation", f"the {key} annotation cannot be read: {str(exc)[:200]}"
    return state, "fits", ""


def record_of(node: Mapping[str, Any], prefix: str) -> NodeRecord:
    state, code, reason = read_node_state(node, prefix)
    return NodeRecord(state, code, reason, card_rooms(state) if state is not None else ())


def node_name(node: Mapping[str, Any]) -> str:
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""
