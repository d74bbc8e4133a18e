"""Where the daemon's card state is written, and only when it changed.

:class:`StatePublisher` writes what :class:`~gpushare.kube.apilink.ApiLink` computes to
the places its mode names (:data:`gpushare.kube.stateobject.MODES`): the node's state
object (ConfigMap ``gpushare-node-<node>``), the Node annotation ``<prefix>/gpus``, or
both; the node labels go on the Node whenever they differ from what it shows.

Nothing is written again while nothing changed: instead of a periodic rewrite the link
calls :meth:`StatePublisher.resync` now and then, which reads back what it wrote (a GET
served from the API server's cache) and writes again only what differs: an object
deleted or edited by someone else, an annotation overwritten, a label removed.

A daemon that left mode ``object``/``both`` for ``annotation`` retires its node's state
object: left behind, it would be believed for ever by extenders that prefer the object
(issue 41.3). Deleted by name, only if it is still the object read (preconditions), at
connect and, until that succeeds, at each read-back; a daemon without the right (the
Role of an older release, or none) says so once and publishes on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog

from gpushare.kube import nodestate, stateobject
from gpushare.kube.stdlibclient import ApiClient, ApiStatusError

log = structlog.get_logger(__name__)

API_TIMEOUT = 5.0
#: A GET served from the API server's watch cache, not a quorum read of etcd.
CACHED = {"resourceVersion": "0"}


class StatePublisher:
    """Writes one node's card state and labels where ``mode`` says, counting its writes."""

    def __init__(
        self,
        api: Callable[[], ApiClient | None],
        node: str,
        prefix: str,
        namespace: str,
        mode: str = "both",
    ) -> None:
        if mode not in stateobject.MODES:
            raise ValueError(f"node state mode {mode!r} is not one of {stateobject.MODES}")
        if mode != "annotation" and not stateobject.object_name(node):
            log.warning("node_state_on_node_only", node=node, reason="node name too long")
            mode = "annotation"
        self._api = api
        self.node = node
        self.prefix = prefix
        self.namespace = namespace
        self.mode = mode
        self.node_uid = ""
        #: the Node's ``status.nodeInfo.kubeletVersion`` when last read ("" unknown)
        self.kubelet_version = ""
        #: what this publisher last wrote (None: nothing yet) per place
        self._object_text: str | None = None
        self._annotation_text: str | None = None
        self._labels: dict[str, str] | None = None
        #: the labels and annotation the Node showed when last read
        self._node_labels: dict[str, str] = {}
        self._node_has_annotation = False
        self._object_exists = False
        #: mode ``both`` and the objects are forbidden (RBAC not upgraded yet): the
        #: annotation alone is written, and the object tried again at each read-back
        self.object_forbidden = False
        #: writes by kind ("object", "node"), and resyncs done, for tests and benchmarks
        self.writes: dict[str, int] = {"object": 0, "node": 0}
        self.resyncs = 0
        self.retired = 0  # state objects deleted (mode ``annotation``)
        #: mode ``annotation``: an object left from ``object``/``both`` may still be there
        self._retire_pending = not self.writes_object

    @property
    def writes_object(self) -> bool:
        return self.mode in ("both", "object")

    @property
    def writes_annotation(self) -> bool:
        return self.mode in ("both", "annotation")

    @property
    def node_path(self) -> str:
        return f"/api/v1/nodes/{self.node}"

    @property
    def object_path(self) -> str:
        name = stateobject.object_name(self.node)
        return f"{stateobject.configmaps_path(self.namespace)}/{name}"

    def _client(self) -> ApiClient:
        api = self._api()
        assert api is not None
        return api

    # ------------------------------------------------------------------ reading back
    def _read_node(self) -> str | None:
        """Read the Node (its UID, labels, annotation); the annotation's text."""
        node = self._client().get(self.node_path, timeout=API_TIMEOUT, **CACHED)
        meta = node.get("metadata") or {}
        self.node_uid = str(meta.get("uid") or self.node_uid)
        info = (node.get("status") or {}).get("nodeInfo") or {}
        version = info.get("kubeletVersion") if isinstance(info, dict) else None
        self.kubelet_version = version if isinstance(version, str) else self.kubelet_version
        labels = meta.get("labels")
        self._node_labels = dict(labels) if isinstance(labels, Mapping) else {}
        annotations = meta.get("annotations") or {}
        text = annotations.get(nodestate.annotation_key(self.prefix))
        self._node_has_annotation = isinstance(text, str)
        return text if isinstance(text, str) else None

    def _read_object(self) -> dict[str, Any] | None:
        try:
            found = self._client().get(self.object_path, timeout=API_TIMEOUT, **CACHED)
        except ApiStatusError as exc:
            if exc.status == 404:
                self._object_exists = False
                return None
            self._forbidden(exc)
            return None
        self._object_exists = True
        return found if isinstance(found, dict) else None

    def _object_text_of(self, found: Mapping[str, Any] | None) -> str | None:
        if found is None:
            return None
        read = stateobject.read_state_object(found, self.prefix)
        if read.problem or (self.node_uid and read.owner_uid != self.node_uid):
            return None
        return read.text

    def connect(self) -> int:
        """Read what the Node and the state object show now; the highest generation
        published before (0: none), which the next state must pass."""
        generations = [0]
        text = self._read_node()
        if text:
            generations.append(_generation(text))
        if self.writes_object:
            found = self._object_text_of(self._read_object())
            if found:
                generations.append(_generation(found))
        elif self._retire_pending:
            generations.append(self._retire_object())
        return max(generations)

    def _retire_object(self) -> int:
        """Mode ``annotation``: delete this node's state object, left from mode
        ``object``/``both`` and no longer kept up to date; the generation it carried
        (0: none), which the next annotation passes."""
        client = self._client()
        try:
            found = client.get(self.object_path, timeout=API_TIMEOUT, **CACHED)
        except ApiStatusError as exc:
            return self._not_retired(exc, 0)
        text = self._object_text_of(found if isinstance(found, dict) else None)
        generation = _generation(text) if text else 0
        meta = found.get("metadata") if isinstance(found, dict) else None
        meta = meta if isinstance(meta, dict) else {}
        preconditions = {k: meta[k] for k in ("uid", "resourceVersion") if meta.get(k)}
        try:
            client.request(
                "DELETE",
                self.object_path,
                body={"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": preconditions},
                content_type="application/json",
                timeout=API_TIMEOUT,
            )
        except ApiStatusError as exc:
            return self._not_retired(exc, generation)
        self._retire_pending = False
        self.retired += 1
        log.info(
            "node_state_object_retired",
            node=self.node,
            path=self.object_path,
            generation=generation,
            reason="--node-state annotation: the object is no longer written",
        )
        return generation

    def _not_retired(self, exc: ApiStatusError, generation: int) -> int:
        """A GET or DELETE of the object to retire failed: gone already (done), not
        allowed (said once; the object stays and its readers fall back to the annotation
        once it is older), or anything else (changed since it was read, a server error:
        tried again at the next read-back). Never raised: publishing does not wait on it."""
        if exc.status == 404:
            self._retire_pending = False
        elif exc.status != 403:
            log.info("node_state_object_retire_later", node=self.node, error=str(exc)[:200])
        else:
            self._retire_pending = False
            log.warning(
                "node_state_object_not_retired",
                node=self.node,
                path=self.object_path,
                error=str(exc)[:200],
                hint="give the daemon's Role get and delete on configmaps (this release's "
                "manifests), or delete the object by hand",
            )
        return generation

    # ------------------------------------------------------------------ writing
    def publish(self, text: str, labels: Mapping[str, str]) -> None:
        """Write a new state (``nodestate.encode``'s text) and the node's labels."""
        if self.writes_object and not self.object_forbidden:
            try:
                self._write_object(text)
            except ApiStatusError as exc:
                self._forbidden(exc)
        if self.writes_annotation:
            self._write_node(labels, text)
        elif self._labels_differ(labels) or self._node_has_annotation:
            self._write_node(labels, None)

    def _forbidden(self, exc: ApiStatusError) -> None:
        """In mode ``both`` a 403 on the object (a daemon upgraded before its Role)
        leaves the annotation to carry the state; anywhere else it is an error."""
        if exc.status != 403 or self.mode != "both":
            raise exc
        if not self.object_forbidden:
            log.warning(
                "node_state_object_forbidden",
                node=self.node,
                path=self.object_path,
                fallback="the Node annotation only (the Role of this release is missing)",
            )
        self.object_forbidden = True

    def _labels_differ(self, labels: Mapping[str, str]) -> bool:
        return any(self._node_labels.get(k) != v for k, v in labels.items())

    def _write_object(self, text: str) -> None:
        body = stateobject.state_object(self.prefix, self.namespace, self.node, self.node_uid, text)
        client = self._client()
        if self._object_exists:
            try:
                client.merge_patch(self.object_path, body, timeout=API_TIMEOUT)
            except ApiStatusError as exc:
                if exc.status != 404:
                    raise
                self._object_exists = False
        if not self._object_exists:
            try:
                client.request(
                    "POST",
                    stateobject.configmaps_path(self.namespace),
                    body=body,
                    content_type="application/json",
                    timeout=API_TIMEOUT,
                )
            except ApiStatusError as exc:
                if exc.status != 409:  # made meanwhile (another of our writes): patch it
                    raise
                client.merge_patch(self.object_path, body, timeout=API_TIMEOUT)
            self._object_exists = True
        self.writes["object"] += 1
        self._object_text = text

    def _write_node(self, labels: Mapping[str, str], text: str | None) -> None:
        """Patch the Node: the labels, and the annotation (``text``; None: removed when
        the Node has one, in mode ``object``)."""
        metadata: dict[str, Any] = {"labels": dict(labels)}
        if text is not None or self._node_has_annotation:
            metadata["annotations"] = {nodestate.annotation_key(self.prefix): text}
        self._client().merge_patch(self.node_path, {"metadata": metadata}, timeout=API_TIMEOUT)
        self.writes["node"] += 1
        self._labels = dict(labels)
        self._node_labels.update(labels)
        self._node_has_annotation = text is not None
        if text is not None:
            self._annotation_text = text

    # ------------------------------------------------------------------ resync
    def resync(self, labels: Mapping[str, str]) -> bool:
        """Read back what was written and rewrite what differs; True if it wrote."""
        self.resyncs += 1
        wrote = False
        if self._retire_pending:
            self._retire_object()
        if self.object_forbidden and self._annotation_text is not None:
            self.object_forbidden = False  # the Role may have come meanwhile: try again
            try:
                self._write_object(self._annotation_text)
                log.info("node_state_object_allowed", node=self.node)
                wrote = True
            except ApiStatusError as exc:
                self._forbidden(exc)
        elif self.writes_object and self._object_text is not None:
            shown = self._object_text_of(self._read_object())
            if shown != self._object_text and not self.object_forbidden:
                log.info("node_state_resynced", node=self.node, place="object")
                try:
                    self._write_object(self._object_text)
                    wrote = True
                except ApiStatusError as exc:
                    self._forbidden(exc)
        annotation = self._read_node()
        if self.writes_annotation and self._annotation_text is not None:
            if annotation != self._annotation_text or self._labels_differ(labels):
                log.info("node_state_resynced", node=self.node, place="annotation")
                self._write_node(labels, self._annotation_text)
                wrote = True
        elif not self.writes_annotation and (
            self._labels_differ(labels) or self._node_has_annotation
        ):
            log.info("node_state_resynced", node=self.node, place="labels")
            self._write_node(labels, None)
            wrote = True
        return wrote


def _generation(text: str) -> int:
    try:
        return nodestate.decode(text).generation
    except ValueError:
        return 0
