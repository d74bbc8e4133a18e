"""The node's card state as an object of its own: one ConfigMap per node.

The card state (``nodestate.encode``, the same JSON as the Node annotation
``<prefix>/gpus``) used to live on the Node, where every write rewrites the whole Node
(11-32 KB in etcd) and goes to every Node watcher of the cluster (kube-scheduler, the
controller manager, network agents). It is published instead as ConfigMap
``gpushare-node-<node>`` in the daemon's namespace, which only its readers (the
scheduler extender, ``kubectl gpushare inspect``) watch or read::

    apiVersion: v1
    kind: ConfigMap
    metadata:
      name: gpushare-node-node-1
      namespace: kube-system                 # the daemon's own (POD_NAMESPACE)
      labels: {gpushare.io/node-state: "true"}
      annotations: {gpushare.io/node: node-1}
      ownerReferences: [{apiVersion: v1, kind: Node, name: node-1, uid: ...}]
    data:
      gpus: '{"version": 1, "generation": 7, ...}'

The owner reference makes the garbage collector delete it with its Node. A reader
believes an object only if it is self-consistent (:func:`read_state_object`): its name
is ``gpushare-node-`` + the node its annotation names, and it is owned by that Node
(by UID too, where the reader knows the Node's). Which token may write which object is
bounded by the node-scope admission policy (docs/security.md): the daemon's token only
``gpushare-node-<its own node>``.

:data:`MODES` says where a daemon publishes (``--node-state``): ``annotation`` (the Node
only, as before 0.2), ``both`` (the object and the Node annotation, for old extenders
during a rollout; the default of this release) and ``object`` (the object only; the
annotation is removed once, so that no reader keeps a state nobody updates).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Where the daemon publishes its card state (``--node-state``).
MODES = ("annotation", "both", "object")
OBJECT_PREFIX = "gpushare-node-"
#: The longest ConfigMap name (a DNS subdomain); a node whose name makes it longer
#: publishes on its Node only.
MAX_OBJECT_NAME = 253
#: The data key holding ``nodestate.encode``'s JSON.
DATA_KEY = "gpus"
#: The daemon's namespace when neither POD_NAMESPACE nor the service account says.
DEFAULT_NAMESPACE = "kube-system"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def object_name(node: str) -> str:
    """``gpushare-node-<node>``, or "" when that is longer than a name may be."""
    name = OBJECT_PREFIX + node
    return name if len(name) <= MAX_OBJECT_NAME else ""


def selector_label(prefix: str) -> str:
    """The label every state object carries (what readers select by)."""
    return f"{prefix}/node-state"


def node_annotation(prefix: str) -> str:
    """The object's annotation naming its node (node names may be longer than a label
    value may be)."""
    return f"{prefix}/node"


def selector(prefix: str) -> str:
    return f"{selector_label(prefix)}=true"


def configmaps_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/configmaps"


def state_object(
    prefix: str, namespace: str, node: str, node_uid: str, text: str
) -> dict[str, Any]:
    """The whole ConfigMap a daemon writes for ``node`` (``text``: ``nodestate.encode``)."""
    owner: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "name": node}
    if node_uid:
        owner["uid"] = node_uid
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": object_name(node),
            "namespace": namespace,
            "labels": {selector_label(prefix): "true", "app.kubernetes.io/part-of": "gpushare"},
            "annotations": {node_annotation(prefix): node},
            "ownerReferences": [owner],
        },
        "data": {DATA_KEY: text},
    }


@dataclass(frozen=True)
class StateObject:
    """What a reader takes from one state object: whose it is and its state's text, or
    why it is not believed (``problem``)."""

    node: str
    text: str | None
    problem: str = ""
    owner_uid: str = ""


def read_state_object(obj: Mapping[str, Any], prefix: str) -> StateObject:
    """The node and card-state text of a state object, checked for consistency: the
    name is ``gpushare-node-`` + the node its annotation names and the owner is that
    Node. Anything else is reported as a ``problem`` (and its text not used)."""
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    name = meta.get("name") if isinstance(meta.get("name"), str) else ""
    annotations = meta.get("annotations")
    node = annotations.get(node_annotation(prefix)) if isinstance(annotations, Mapping) else None
    if not isinstance(node, str) or not node or object_name(node) != name:
        node = str(name).removeprefix(OBJECT_PREFIX) if str(name).startswith(OBJECT_PREFIX) else ""
        return StateObject(
            node, None, f"the state object {name} names no node, or another node than its name"
        )
    owners = meta.get("ownerReferences")
    owned = [
        o
        for o in (owners if isinstance(owners, list) else [])
        if isinstance(o, Mapping) and o.get("kind") == "Node" and o.get("name") == node
    ]
    if not owned:
        return StateObject(node, None, f"the state object {name} is not owned by Node {node}")
    data = obj.get("data")
    text = data.get(DATA_KEY) if isinstance(data, Mapping) else None
    if not isinstance(text, str):
        return StateObject(node, None, f"the state object {name} holds no {DATA_KEY} entry")
    return StateObject(node, text, "", str(owned[0].get("uid") or ""))


def own_namespace(environ: Mapping[str, str]) -> str:
    """The daemon's namespace: POD_NAMESPACE (the downward API), else its service
    account's, else :data:`DEFAULT_NAMESPACE`."""
    given = environ.get("POD_NAMESPACE", "").strip()
    if given:
        return given
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as handle:
            text = handle.read(256).strip()
    except OSError:
        text = ""
    return text or DEFAULT_NAMESPACE
