"""What the extender knows of each node's cards, by name, from its own watches.

With ``nodeCacheCapable: true`` kube-scheduler sends only node names; the extender
answers from this cache, which :mod:`gpushare.extender.statefeed` keeps from a
list-and-watch of the nodes' state objects (ConfigMaps ``gpushare-node-<node>``) and
:mod:`gpushare.extender.nodefeed` from one of the Nodes (their UIDs, and the
``<prefix>/gpus`` annotation of daemons that publish no object). Where a node has both,
the newer of the two is believed (its ``updated`` time, then its generation; a tie goes
to the object): an object left behind by a daemon switched to ``nodeState: annotation``
no longer outranks what the daemon writes now (issue 41.3). The annotation is read too
where the node has no object the cache believes (one of an older daemon, or during a
rollout). Of each only what the
verbs read is kept: the published card state (decoded once, when it changes, not once
per request) or why there is none (:class:`NodeRecord`). The cost of a filter is then
the fitting alone, and a request is a list of names (about 20 bytes a node), so no
cluster size reaches the body limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpushare.extender.fit import CardRoom, card_rooms
from gpushare.kube import nodestate, stateobject


@dataclass(frozen=True)
class NodeRecord:
    """One node as the verbs need it: its published cards, or ``code``/``reason``."""

    state: nodestate.NodeGpuState | None
    code: str = "fits"
    reason: str = ""
    #: ``card_rooms(state)``, computed once per published state
    rooms: tuple[CardRoom, ...] = ()
    #: the Node's UID (a record from the node feed)
    uid: str = ""


@dataclass(frozen=True)
class StateRecord:
    """One state object as the cache keeps it: the node it is for, its name, the Node
    UID that owns it, and the card state it holds (or why it is not used)."""

    node: str
    name: str
    owner_uid: str
    record: NodeRecord


@dataclass
class NodeCache:
    """node name -> :class:`NodeRecord`, from the Nodes (``records``) and the state
    objects (``objects``); ``listed`` once the first list of each feed is read
    (``expect_objects``: a state feed runs).

    Written only on the extender's event loop (by the feeds), read by the verbs."""

    records: dict[str, NodeRecord] = field(default_factory=dict)
    objects: dict[str, StateRecord] = field(default_factory=dict)
    expect_objects: bool = False
    nodes_listed: bool = False
    objects_listed: bool = False

    @property
    def listed(self) -> bool:
        return self.nodes_listed and (self.objects_listed or not self.expect_objects)

    def __len__(self) -> int:
        return len(self.records.keys() | self.objects.keys())

    def get(self, name: str) -> NodeRecord | None:
        """The node's state object if the cache believes it, else what its Node says."""
        node = self.records.get(name)
        held = self.objects.get(name)
        if held is None:
            return node
        if node is not None and node.uid and held.owner_uid != node.uid:
            if node.state is not None:
                return node
            reason = (
                f"the state object {held.name} belongs to an earlier Node of that name "
                "(its owner's UID differs); waiting for the daemon to write it again"
            )
            return NodeRecord(None, "stale_state", reason, uid=node.uid)
        if node is not None and node.state is not None:
            if held.record.state is None:
                return node  # an object not believed: the annotation, as older daemons write
            if nodestate.recency(node.state) > nodestate.recency(held.record.state):
                return node  # the object is older: left behind, no longer written
        return held.record

    def replace_all(self, records: dict[str, NodeRecord]) -> None:
        self.records = records
        self.nodes_listed = True

    def put(self, name: str, record: NodeRecord) -> None:
        self.records[name] = record

    def drop(self, name: str) -> None:
        self.records.pop(name, None)

    def replace_objects(self, objects: dict[str, StateRecord]) -> None:
        self.objects = objects
        self.objects_listed = True

    def objects_unreadable(self) -> None:
        """The state objects cannot be listed (no RBAC yet): serve the annotations."""
        self.objects_listed = True

    def put_object(self, record: StateRecord) -> None:
        self.objects[record.node] = record

    def drop_object(self, node: str, name: str) -> None:
        held = self.objects.get(node)
        if held is not None and held.name == name:
            del self.objects[node]


def _has_resource(node: Mapping[str, Any], resource: str) -> bool:
    status = node.get("status")
    if not isinstance(status, Mapping):
        return False
    for key in ("allocatable", "capacity"):
        amounts = status.get(key)
        if isinstance(amounts, Mapping) and str(amounts.get(resource, "0")) not in ("0", ""):
            return True
    return False


def _has_daemon_label(meta: Any, prefix: str) -> bool:
    """Whether the node carries a label only the daemon writes (the node feed reads
    Nodes as their metadata only: no status to find the resources in)."""
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    return isinstance(labels, Mapping) and any(k in labels for k in nodestate.label_keys(prefix))


def read_node_state(
    node: Mapping[str, Any], prefix: str
) -> tuple[nodestate.NodeGpuState | None, str, str]:
    """(state, code, reason): the node's published cards, or why there are none."""
    key = nodestate.annotation_key(prefix)
    meta = node.get("metadata") or {}
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    text = annotations.get(key) if isinstance(annotations, Mapping) else None
    if not isinstance(text, str):
        if (
            _has_resource(node, f"{prefix}/vcuda-memory")
            or _has_resource(node, f"{prefix}/vcuda-core")
            or _has_daemon_label(meta, prefix)
        ):
            return (
                None,
                "no_annotation",
                (
                    f"the node has gpushare resources but neither a state object nor a {key} "
                    "annotation, so its cards are unknown (is the gpushare daemon running "
                    "there with NODE_NAME set?)"
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
    meta = node.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    rooms = card_rooms(state) if state is not None else ()
    return NodeRecord(state, code, reason, rooms, uid if isinstance(uid, str) else "")


def state_record_of(obj: Mapping[str, Any], prefix: str) -> StateRecord:
    """A state object read, checked and decoded (see ``stateobject.read_state_object``)."""
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    read = stateobject.read_state_object(obj, prefix)
    if read.text is None:
        record = NodeRecord(None, "bad_state_object", read.problem)
    else:
        try:
            state = nodestate.decode(read.text)
            rooms = card_rooms(state)
        except (ValueError, RecursionError) as exc:
            reason = f"the state object {name} cannot be read: {str(exc)[:200]}"
            record = NodeRecord(None, "bad_state_object", reason)
        else:
            record = NodeRecord(state, "fits", "", rooms)
    return StateRecord(read.node, name if isinstance(name, str) else "", read.owner_uid, record)


def node_name(node: Mapping[str, Any]) -> str:
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""
