"""A test double of the Kubernetes API server at the HTTP boundary.

Small and in-process: objects are stored by URL path, and the verbs the project's
code uses are served (GET one, or a list with label/field selectors (``=``, ``!=``) in
pages (``limit``/``continue``) streamed one item at a time; discovery documents of
:data:`GROUPS`; POST, PATCH as
JSON merge patch, strategic merge patch or server-side apply, DELETE, and the
``pods/{name}/binding`` subresource), for the kinds in :data:`KINDS`. Server-side
apply checks what the real server checks of a request (a fieldManager, a body naming
the URL's object) and is a no-op, keeping the resourceVersion, when it changes
nothing. Every request is recorded, and the next requests can be made to fail.

Watches (``?watch=1``) are served as the real server does over HTTP/1.1: a chunked
answer of one JSON event per line (ADDED, MODIFIED, DELETED; an object that starts or
stops matching the watch's selectors comes as ADDED or DELETED; BOOKMARK every
``bookmark_seconds`` when asked with ``allowWatchBookmarks``), from the given
``resourceVersion`` on, ended after ``timeoutSeconds``. A resourceVersion older than the
kept history (see :meth:`KubeApiDouble.compact`) answers an ERROR event with a 410
Status, as etcd's compaction makes the real server do. A pod list asked for in protobuf
first (``Accept: application/vnd.kubernetes.protobuf, ...``) is answered in protobuf, as
kube-apiserver does, with the fields ``proto/kubeapi`` names (``protobuf = False``: JSON
always, as a JSON-only proxy). Lives in the package so that
``make bench`` can run the daemon against it.

``resource.k8s.io/v1`` objects (ResourceSlices, ResourceClaims, DeviceClasses) are kept
as written, like the 1.36 server does with its DRA gates on; PUT replaces an object (a
stale ``metadata.resourceVersion`` is a 409), ``dryRun=All`` answers what would be
stored without storing it, and DELETE of a collection removes what its selectors match.
:attr:`KubeApiDouble.consumable_capacity` and :attr:`KubeApiDouble.device_taints` set to
False make it drop, silently, what a server with those feature gates off drops
(``allowMultipleAllocations`` and the capacities' ``requestPolicy``; device ``taints``).
"""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
import time
from collections.abc import Iterator
from copy import deepcopy
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import yaml

from gpushare._proto.kubeapi.v1 import pods_pb2
from gpushare.kube.protolist import MAGIC, PROTOBUF

KINDS = {
    "nodes": "Node",
    "pods": "Pod",
    "namespaces": "Namespace",
    "configmaps": "ConfigMap",
    "serviceaccounts": "ServiceAccount",
    "events": "Event",
    "clusterroles": "ClusterRole",
    "clusterrolebindings": "ClusterRoleBinding",
    "roles": "Role",
    "rolebindings": "RoleBinding",
    "daemonsets": "DaemonSet",
    "resourceslices": "ResourceSlice",
    "resourceclaims": "ResourceClaim",
    "deviceclasses": "DeviceClass",
    "networkpolicies": "NetworkPolicy",
    "validatingadmissionpolicies": "ValidatingAdmissionPolicy",
    "validatingadmissionpolicybindings": "ValidatingAdmissionPolicyBinding",
}
#: The group/versions whose discovery document the double serves (kinds by plural).
GROUPS = {
    "v1": ("nodes", "pods", "namespaces", "configmaps", "serviceaccounts", "events"),
    "rbac.authorization.k8s.io/v1": (
        "clusterroles",
        "clusterrolebindings",
        "roles",
        "rolebindings",
    ),
    "apps/v1": ("daemonsets",),
    "networking.k8s.io/v1": ("networkpolicies",),
    "admissionregistration.k8s.io/v1": (
        "validatingadmissionpolicies",
        "validatingadmissionpolicybindings",
    ),
    "resource.k8s.io/v1": ("resourceslices", "resourceclaims", "deviceclasses"),
}
#: Stamps the server keeps on an object; an apply that changes nothing else is a no-op.
_SERVER_FIELDS = ("resourceVersion", "uid", "managedFields", "creationTimestamp")


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: Any
    authorization: str = ""
    client_cert: bool = False  # a TLS client certificate was presented
    at: float = field(default_factory=time.monotonic)  # when it arrived
    accept: str = ""
    port: int = 0  # the client's port: one per connection


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (also how this double treats strategic merge)."""
    if not isinstance(patch, dict):
        return deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _matches_labels(obj: dict[str, Any], selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _matches_fields(obj: dict[str, Any], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        negated = "!=" in term
        key, _, value = term.partition("!=" if negated else "=")
        current: Any = obj
        for part in key.split("."):
            current = current.get(part) if isinstance(current, dict) else None
        if (str(current or "") == value) is negated:
            return False
    return True


def _is_collection(parts: list[str]) -> bool:
    """``/api/v1/nodes`` or ``/apis/g/v/namespaces/ns/things``, not ``.../things/name``."""
    rest = parts[3:] if parts[1] == "api" else parts[4:]
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    return len(rest) == 1


#: One change kept in the history: (resourceVersion, ADDED|MODIFIED|DELETED, key, the
#: object, the object before it).
_Event = tuple[int, str, str, dict[str, Any], dict[str, Any] | None]


class ObjectStore:
    """The double's objects: one version counter, every change an event (what watches
    replay), and the helpers tests use to put objects in place without HTTP."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}  # collection path/name -> object
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._version = 1
        #: (resourceVersion, type, key, object, the object's previous copy or None)
        self.events: list[_Event] = []
        self._recorded: dict[str, dict[str, Any]] = {}  # key -> the copy last recorded
        self._oldest = 1  # watches from before this version answer 410 Gone
        self._stopping = False
        self.bookmark_seconds = 60.0
        #: Pod lists asked for in protobuf first are answered in protobuf (False: JSON
        #: always, as a proxy or a server that only speaks JSON would).
        self.protobuf = True
        #: Container logs by pod object key, served at ``pods/{name}/log`` as text.
        self.logs: dict[str, str] = {}

    def add(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object (Node, Pod, ...) as if it had been created."""
        kind = obj["kind"]
        plural = next(p for p, k in KINDS.items() if k == kind)
        meta = obj.setdefault("metadata", {})
        base = "/api/v1" if "/" not in obj.get("apiVersion", "v1") else f"/apis/{obj['apiVersion']}"
        namespace = meta.get("namespace")
        collection = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
        with self._lock:
            self._put(f"{collection}/{meta['name']}", obj)
        return obj

    @staticmethod
    def _path(kind: str, name: str, namespace: str | None, api_version: str) -> str:
        plural = next(p for p, k in KINDS.items() if k == kind)
        base = "/api/v1" if "/" not in api_version else f"/apis/{api_version}"
        if namespace:
            return f"{base}/namespaces/{namespace}/{plural}/{name}"
        return f"{base}/{plural}/{name}"

    def get(
        self, kind: str, name: str, namespace: str | None = None, api_version: str = "v1"
    ) -> dict[str, Any] | None:
        with self._lock:
            return deepcopy(self.objects.get(self._path(kind, name, namespace, api_version)))

    def delete(
        self, kind: str, name: str, namespace: str | None = None, api_version: str = "v1"
    ) -> None:
        """Remove an object as a controller would (not recorded as a request)."""
        with self._lock:
            self._drop(self._path(kind, name, namespace, api_version))

    def compact(self) -> None:
        """Forget the change history, as etcd compaction does: older watches get 410."""
        with self._lock:
            self.events.clear()
            self._oldest = self._version + 1

    def calls(self, method: str, path_part: str = "") -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.method == method and path_part in r.path]

    def _put(self, key: str, obj: dict[str, Any]) -> None:
        """Store a new or changed object with a new resourceVersion (lock held)."""
        kind = "MODIFIED" if key in self.objects else "ADDED"
        self._stamp(obj)
        self.objects[key] = obj
        self._record(kind, key, obj)

    def _drop(self, key: str) -> None:
        obj = self.objects.pop(key)
        self._version += 1
        gone = deepcopy(obj)
        gone.setdefault("metadata", {})["resourceVersion"] = str(self._version)
        self._record("DELETED", key, gone)

    def _record(self, kind: str, key: str, obj: dict[str, Any]) -> None:
        copy = deepcopy(obj)
        previous = self._recorded.pop(key, None) if kind == "DELETED" else self._recorded.get(key)
        if kind != "DELETED":
            self._recorded[key] = copy
        self.events.append((self._version, kind, key, copy, previous))
        self._changed.notify_all()

    def _stamp(self, obj: dict[str, Any]) -> None:
        self._version += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self._version)
        meta.setdefault("uid", f"uid-{meta.get('name', '')}-{self._version}")

    def _collections(self, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Objects whose key lies in the collection ``path`` (cluster-wide lists too)."""
        parts = path.rstrip("/").split("/")
        plural = parts[-1]
        for key, obj in self.objects.items():
            key_parts = key.split("/")
            if key_parts[-2] != plural:
                continue
            if "namespaces" in parts and key.rsplit("/", 1)[0] != path.rstrip("/"):
                continue
            yield key, obj

    def _selected(self, path: str, query: dict[str, list[str]]) -> list[str]:
        """The keys of the collection at ``path`` its label and field selectors match
        (lock held)."""
        labels = (query.get("labelSelector") or [""])[0]
        fields = (query.get("fieldSelector") or [""])[0]
        return [
            key
            for key, o in self._collections(path)
            if _matches_labels(o, labels) and _matches_fields(o, fields)
        ]

    def add_many(self, objs: Iterator[dict[str, Any]]) -> int:
        """Store objects as if they had been there before any watch began: no events,
        no copies (large objects may share parts), for measurements at scale."""
        count = 0
        with self._lock:
            for obj in objs:
                meta = obj["metadata"]
                plural = next(p for p, k in KINDS.items() if k == obj["kind"])
                namespace = meta.get("namespace")
                base = f"/api/v1/namespaces/{namespace}" if namespace else "/api/v1"
                self._version += 1
                meta["resourceVersion"] = str(self._version)
                meta.setdefault("uid", f"uid-{meta['name']}-{self._version}")
                self.objects[f"{base}/{plural}/{meta['name']}"] = obj
                count += 1
            self._oldest = self._version + 1  # no history before them
        return count

    def _in_collection(self, key: str, path: str) -> bool:
        parts = path.rstrip("/").split("/")
        if key.split("/")[-2] != parts[-1]:
            return False
        return "namespaces" not in parts or key.rsplit("/", 1)[0] == path.rstrip("/")


def _first_accept(request: BaseHTTPRequestHandler) -> str:
    """The first media range of the request's Accept header (the client's choice)."""
    return (request.headers.get("Accept") or "").split(",")[0]


def _wants_metadata(request: BaseHTTPRequestHandler) -> str:
    """``PartialObjectMetadataList``/``PartialObjectMetadata`` when the Accept header's
    first choice asks for objects as their metadata only (``as=...;g=meta.k8s.io``),
    else ""."""
    first = _first_accept(request)
    params = dict(p.strip().partition("=")[::2] for p in first.split(";")[1:])
    if params.get("g") == "meta.k8s.io" and params.get("as", "").startswith("PartialObject"):
        return params["as"]
    return ""


def _wants_protobuf(request: BaseHTTPRequestHandler) -> bool:
    """The Accept header's first choice is protobuf (kube-apiserver then answers a
    built-in type's list in protobuf)."""
    return _first_accept(request).split(";")[0].strip() == PROTOBUF


def _pod_list_protobuf(meta: dict[str, Any], pods: list[dict[str, Any]]) -> bytes:
    """A page of pods framed as kube-apiserver frames a protobuf answer, each pod
    encoded with the fields ``proto/kubeapi`` names (the real server sends more; a
    reader skips what it does not name)."""

    def container(c: dict[str, Any]) -> pods_pb2.Container:
        resources = c.get("resources") or {}
        return pods_pb2.Container(
            name=str(c.get("name") or ""),
            restartPolicy=str(c.get("restartPolicy") or ""),
            resources=pods_pb2.ResourceRequirements(
                limits={
                    k: pods_pb2.Quantity(string=str(v))
                    for k, v in (resources.get("limits") or {}).items()
                },
                requests={
                    k: pods_pb2.Quantity(string=str(v))
                    for k, v in (resources.get("requests") or {}).items()
                },
            ),
        )

    def pod(obj: dict[str, Any]) -> pods_pb2.Pod:
        m, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        return pods_pb2.Pod(
            metadata=pods_pb2.ObjectMeta(
                name=str(m.get("name") or ""),
                namespace=str(m.get("namespace") or ""),
                uid=str(m.get("uid") or ""),
                annotations={str(k): str(v) for k, v in (m.get("annotations") or {}).items()},
            ),
            spec=pods_pb2.PodSpec(
                nodeName=str(spec.get("nodeName") or ""),
                containers=[container(c) for c in spec.get("containers") or []],
                initContainers=[container(c) for c in spec.get("initContainers") or []],
            ),
            status=pods_pb2.PodStatus(phase=str((obj.get("status") or {}).get("phase") or "")),
        )

    listed = pods_pb2.PodList(items=[pod(obj) for obj in pods])
    listed.metadata.resourceVersion = str(meta.get("resourceVersion") or "")
    setattr(listed.metadata, "continue", str(meta.get("continue") or ""))
    wrapped = pods_pb2.Unknown(raw=listed.SerializeToString(), contentType=PROTOBUF)
    return MAGIC + wrapped.SerializeToString()


def _metadata_of(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as the real server sends it to a metadata-only reader."""
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": deepcopy(obj.get("metadata") or {}),
    }


def _status(code: int, message: str) -> dict[str, Any]:
    """A ``Status`` answer, as the real server gives with an error."""
    reason = {404: "NotFound", 409: "AlreadyExists", 400: "BadRequest"}.get(
        code, "InternalError"
    )
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _not_acceptable(asked: str, what: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": f"you requested {asked}, but the requested object is {what}",
        "reason": "NotAcceptable",
        "code": 406,
    }


class CollectionReads(ObjectStore):
    """The double's reads of a collection: lists (label and field selectors, pages with
    ``limit``/``continue``, streamed one item at a time) and watches (events from a
    resourceVersion, bookmarks, 410 Gone before the oldest kept)."""

    def _list(
        self, request: BaseHTTPRequestHandler, path: str, query: dict[str, list[str]]
    ) -> None:
        """A list, in pages when asked (``limit``, ``continue``), streamed one item at a
        time: each item is serialised under the lock, written without it, so a list of
        thousands of large objects never sits in this process as one answer."""
        try:
            limit = int((query.get("limit") or ["0"])[0] or 0)
            version, _, start = ((query.get("continue") or [""])[0] or ":0").partition(":")
            offset = int(start)
        except ValueError:
            return self._reply(request, 400, _status(400, "limit/continue is not valid"))
        with self._lock:
            version = version or str(self._version)
            if int(version) < self._oldest - 1:
                gone = _status(410, "the continue token has expired") | {"reason": "Expired"}
                return self._reply(request, 410, gone | {"code": 410})
            keys = self._selected(path, query)
        page = keys[offset : offset + limit] if limit > 0 else keys[offset:]
        more = limit > 0 and offset + limit < len(keys)
        meta: dict[str, Any] = {"resourceVersion": version}
        if more:
            meta["continue"] = f"{version}:{offset + limit}"
        kind = KINDS.get(path.rstrip("/").split("/")[-1], "Object") + "List"
        head = {"kind": kind, "apiVersion": "v1", "metadata": meta}
        as_metadata = _wants_metadata(request)
        if as_metadata == "PartialObjectMetadata":
            return self._reply(request, 406, _not_acceptable(as_metadata, "a list"))
        if as_metadata:
            head = {"kind": as_metadata, "apiVersion": "meta.k8s.io/v1", "metadata": meta}
        if kind == "PodList" and not as_metadata and self.protobuf and _wants_protobuf(request):
            return self._send_pod_list_protobuf(request, meta, page)
        return self._stream_list(request, head, page, bool(as_metadata))

    def _send_pod_list_protobuf(
        self, request: BaseHTTPRequestHandler, meta: dict[str, Any], page: list[str]
    ) -> None:
        """A page of pods in protobuf, as kube-apiserver answers a client asking it first."""
        with self._lock:
            pods = [self.objects[key] for key in page if key in self.objects]
            answer = _pod_list_protobuf(meta, pods)
        request.send_response(200)
        request.send_header("Content-Type", PROTOBUF)
        request.send_header("Content-Length", str(len(answer)))
        request.end_headers()
        with contextlib.suppress(OSError):
            request.wfile.write(answer)

    def _stream_list(
        self,
        request: BaseHTTPRequestHandler,
        head: dict[str, Any],
        page: list[str],
        as_metadata: bool,
    ) -> None:
        """The list's JSON, chunked: ``head`` then each item of ``page`` still stored."""
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()

        def send(data: bytes) -> None:
            if data:
                request.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        try:
            send(json.dumps(head).encode()[:-1] + b', "items": [')
            first = True
            for key in page:
                with self._lock:
                    obj = self.objects.get(key)
                    if obj is not None and as_metadata:
                        obj = _metadata_of(obj)
                    data = json.dumps(obj).encode() if obj is not None else b""
                if data:
                    send(data if first else b"," + data)
                    first = False
                del data
            send(b"]}")
            request.wfile.write(b"0\r\n\r\n")
            request.wfile.flush()
        except OSError:
            request.close_connection = True  # the client went away

    def _watch(
        self, request: BaseHTTPRequestHandler, path: str, query: dict[str, list[str]]
    ) -> None:
        labels = (query.get("labelSelector") or [""])[0]
        fields = (query.get("fieldSelector") or [""])[0]
        bookmarks = (query.get("allowWatchBookmarks") or [""])[0] == "true"
        timeout = float((query.get("timeoutSeconds") or ["1800"])[0])
        try:
            since = int((query.get("resourceVersion") or ["0"])[0] or 0)
        except ValueError:
            return self._reply(request, 400, _status(400, "resourceVersion is not a number"))
        as_metadata = _wants_metadata(request)
        if as_metadata == "PartialObjectMetadataList":
            return self._reply(request, 406, _not_acceptable(as_metadata, "not a list"))
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()

        def send(event: dict[str, Any]) -> None:
            line = json.dumps(event).encode() + b"\n"
            request.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            request.wfile.flush()

        fault = str(getattr(self, "watch_fault", ""))  # Faults' (the double's own)
        deadline = time.monotonic() + (0.0 if fault == "end" else timeout)
        next_bookmark = time.monotonic() + self.bookmark_seconds
        try:
            with self._lock:
                pending, position = self._watch_from(since, fault)
            while position is not None:
                for event in pending:
                    send(event)
                with self._lock:
                    now = time.monotonic()
                    if self._stopping or now >= deadline:
                        break
                    wait = min(deadline, next_bookmark if bookmarks else deadline) - now
                    fresh = self._events_after(position, wait)
                    if fresh:
                        position = fresh[-1][0]
                    pending = self._watch_events(fresh, path, labels, fields, bool(as_metadata))
                    if bookmarks and time.monotonic() >= next_bookmark:
                        next_bookmark = time.monotonic() + self.bookmark_seconds
                        pending.append(
                            {
                                "type": "BOOKMARK",
                                "object": {"metadata": {"resourceVersion": str(self._version)}},
                            }
                        )
                        position = self._version
            for event in pending if position is None else []:
                send(event)
            request.wfile.write(b"0\r\n\r\n")
            request.wfile.flush()
        except OSError:
            pass  # the client went away
        request.close_connection = True

    def _watch_from(self, since: int, fault: str) -> tuple[list[dict[str, Any]], int | None]:
        """Where a watch from ``since`` starts: (no events, the version), or (a 410
        ERROR event, None) before the oldest kept version (lock held)."""
        if fault == "gone" or (since and since < self._oldest - 1):
            gone = _status(410, "too old resource version") | {"reason": "Expired"}
            return [{"type": "ERROR", "object": gone}], None
        return [], since or self._version

    def _events_after(self, position: int, wait: float) -> list[_Event]:
        """The kept history after ``position``; when there is none yet, what came within
        ``wait`` seconds (lock held, released while waiting)."""
        fresh = [e for e in self.events if e[0] > position]
        if not fresh:
            self._changed.wait(max(0.0, wait))
            fresh = [e for e in self.events if e[0] > position]
        return fresh

    def _watch_events(
        self,
        fresh: list[_Event],
        path: str,
        labels: str,
        fields: str,
        as_metadata: bool,
    ) -> list[dict[str, Any]]:
        """The events a watch of ``path`` with these selectors sends of ``fresh`` (the
        kept history's newer entries; lock held)."""
        pending = []
        for _version, kind, key, obj, previous in fresh:
            if not self._in_collection(key, path):
                continue
            now_in = _matches_labels(obj, labels) and _matches_fields(obj, fields)
            was_in = previous is not None and (
                _matches_labels(previous, labels) and _matches_fields(previous, fields)
            )
            if kind == "MODIFIED" and now_in != was_in:
                # An object that enters or leaves a watch's selectors is
                # ADDED or DELETED there, as the real server sends it.
                kind = "ADDED" if now_in else "DELETED"
                now_in = True
            if now_in:
                shown = _metadata_of(obj) if as_metadata else deepcopy(obj)
                pending.append({"type": kind, "object": shown})
        return pending

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, status: int, answer: Any) -> None:
        data = json.dumps(answer).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _log(self, request: BaseHTTPRequestHandler, pod_key: str) -> None:
        with self._lock:
            exists = pod_key in self.objects
            text = self.logs.get(pod_key, "")
        if not exists:
            return self._reply(request, 404, _status(404, "pod not found"))
        data = text.encode()
        request.send_response(200)
        request.send_header("Content-Type", "text/plain")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)


class ObjectWrites(ObjectStore):
    """The double's writes: create, replace (PUT), merge patch, server-side apply,
    delete (one object or what a collection's selectors match), and the pod binding;
    ResourceSlices stored as a server with the DRA feature gates off stores them."""

    #: DRAConsumableCapacity / DRADeviceTaints of the server (False: dropped on write).
    consumable_capacity = True
    device_taints = True

    def _dispatch(
        self, method: str, path: str, query: dict[str, list[str]], content_type: str, body: Any
    ) -> tuple[int, Any]:
        """A request that is not a list, a watch, discovery or a log (lock held)."""
        parts = path.rstrip("/").split("/")
        dry_run = (query.get("dryRun") or [""])[0] == "All"
        if method in ("POST", "PUT") and isinstance(body, dict):
            body = self._drop_disabled(body)
        if method == "DELETE" and parts[-1] in KINDS:
            for key in self._selected(path, query):
                self._drop(key)
            return 200, _status(200, "deleted") | {"status": "Success"}
        if method == "POST" and parts[-1] in KINDS:
            return self._create(path, body, dry_run)
        key = path.rstrip("/")
        current = self.objects.get(key)
        if method == "POST" and parts[-1] == "binding":
            return self._bind(key.rsplit("/", 1)[0], body)
        if method == "PATCH" and "apply-patch" in content_type:
            return self._apply(parts, key, current, query, body)
        if method not in ("PUT", "GET", "DELETE", "PATCH"):
            return 400, _status(400, f"{method} {path} is not supported by the double")
        if current is None:
            return 404, _status(404, f"{parts[-1]} not found")
        if method == "PUT":
            return self._replace(key, current, body, dry_run)
        if method == "GET":
            return 200, deepcopy(current)
        if method == "DELETE":
            self._drop(key)
            return 200, _status(200, "deleted") | {"status": "Success"}
        if "json-patch" in content_type:  # a PATCH
            return 400, _status(400, "json-patch is not supported by the double")
        merged = merge_patch(current, body)
        self._put(key, merged)
        return 200, deepcopy(merged)

    def _create(self, path: str, body: Any, dry_run: bool) -> tuple[int, Any]:
        """POST to a collection: 409 when the name is taken."""
        name = body["metadata"]["name"]
        key = f"{path.rstrip('/')}/{name}"
        if key in self.objects:
            return 409, _status(409, f"{name} already exists")
        if dry_run:
            return 201, deepcopy(body)
        self._put(key, body)
        return 201, deepcopy(body)

    def _replace(
        self, key: str, current: dict[str, Any], body: Any, dry_run: bool
    ) -> tuple[int, Any]:
        """PUT: a stale ``metadata.resourceVersion`` is a 409; the UID stays."""
        asked = (body.get("metadata") or {}).get("resourceVersion")
        if asked and asked != current["metadata"].get("resourceVersion"):
            return 409, _status(409, "the object has been modified") | {"reason": "Conflict"}
        body.setdefault("metadata", {})["uid"] = current["metadata"].get("uid")
        if dry_run:
            return 200, deepcopy(body)
        self._put(key, body)
        return 200, deepcopy(body)

    def _drop_disabled(self, body: dict[str, Any]) -> dict[str, Any]:
        """What a server with the DRA gates off stores of a ResourceSlice: the gated
        device fields are dropped without a word, as the real strategy's
        dropDisabledFields does."""
        if body.get("kind") != "ResourceSlice":
            return body
        body = deepcopy(body)
        for device in (body.get("spec") or {}).get("devices") or []:
            if not isinstance(device, dict):
                continue
            if not self.consumable_capacity:
                device.pop("allowMultipleAllocations", None)
                for entry in (device.get("capacity") or {}).values():
                    if isinstance(entry, dict):
                        entry.pop("requestPolicy", None)
            if not self.device_taints:
                device.pop("taints", None)
        return body

    def _bind(self, pod_key: str, body: Any) -> tuple[int, Any]:
        """``pods/{name}/binding``: what the real server checks, then ``spec.nodeName``
        and the Binding's annotations merged into the pod's. A UID in the Binding must
        be the pod's (409 otherwise); a bound pod is 409."""
        pod = self.objects.get(pod_key)
        name = pod_key.rsplit("/", 1)[-1]
        if pod is None:
            return 404, _status(404, f'pods "{name}" not found')
        target = body.get("target") if isinstance(body, dict) else None
        meta = body.get("metadata") if isinstance(body, dict) else None
        if not isinstance(target, dict) or not target.get("name") or not isinstance(meta, dict):
            return 400, _status(400, "a Binding needs metadata and target.name")
        uid = meta.get("uid")
        if uid and uid != pod["metadata"]["uid"]:
            return 409, _status(
                409,
                f"Precondition failed: UID in precondition: {uid}, "
                f"UID in object meta: {pod['metadata']['uid']}",
            )
        if (pod.get("spec") or {}).get("nodeName"):
            return 409, _status(
                409, f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"'
            )
        pod.setdefault("spec", {})["nodeName"] = target["name"]
        annotations = meta.get("annotations")
        if isinstance(annotations, dict) and annotations:  # merged, as the real server does
            pod["metadata"].setdefault("annotations", {}).update(
                {str(k): str(v) for k, v in annotations.items()}
            )
        self._put(pod_key, pod)  # a MODIFIED event for watches
        return 201, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    def _apply(
        self,
        parts: list[str],
        key: str,
        current: dict[str, Any] | None,
        query: dict[str, list[str]],
        body: Any,
    ) -> tuple[int, Any]:
        """Server-side apply, as far as a double can: the checks the real server makes on
        the request, create-or-merge, and no new resourceVersion when nothing changed."""
        manager = (query.get("fieldManager") or [""])[0]
        if not manager:
            return 400, _status(400, "PATCH: fieldManager is required for apply requests")
        group_version = "/".join(parts[2:4]) if parts[1] == "apis" else parts[2]
        plural = parts[-2]
        meta = body.get("metadata") if isinstance(body, dict) else None
        if (
            not isinstance(meta, dict)
            or body.get("apiVersion") != group_version
            or body.get("kind") != KINDS.get(plural)
            or meta.get("name") != parts[-1]
        ):
            return 400, _status(400, "apply body does not match the URL")
        namespace = parts[parts.index("namespaces") + 1] if "namespaces" in parts[:-2] else None
        if meta.get("namespace", namespace) != namespace:
            return 400, _status(400, "the namespace of the body does not match the URL")
        merged = merge_patch(current or {}, body)
        merged_meta = merged.setdefault("metadata", {})
        if namespace:
            merged_meta["namespace"] = namespace
        managers = [m for m in merged_meta.get("managedFields", []) if m["manager"] != manager]
        merged_meta["managedFields"] = [*managers, {"manager": manager, "operation": "Apply"}]

        def content(obj: dict[str, Any]) -> dict[str, Any]:
            view = deepcopy(obj)
            for name in _SERVER_FIELDS:
                view.get("metadata", {}).pop(name, None)
            return view

        if current is not None and content(merged) == content(current):
            return 200, deepcopy(current)
        self._put(key, merged)
        return (201 if current is None else 200), deepcopy(merged)


class Faults:
    """What a test makes the double do wrong: answer errors, or hang."""

    def __init__(self) -> None:
        #: (status, path part): the next requests whose path holds that part answer it
        self._failures: list[tuple[int, str]] = []
        self._open = threading.Event()  # cleared while the server is held (hangs)
        self._open.set()
        #: The paths of the requests that arrived while the server was held, in order.
        self.held_paths: list[str] = []
        #: What every watch does instead of watching: "" (watch), "gone" (answer a 410
        #: ERROR event at once, as for a compacted version) or "end" (end at once).
        self.watch_fault = ""
        #: Requests whose path contains one of these are answered 403 Forbidden, as
        #: RBAC answers a verb it does not grant (e.g. "/configmaps").
        self.forbidden_paths: list[str] = []

    def _next_failure(self, path: str) -> int | None:
        """The status the request to ``path`` is answered with instead (lock held)."""
        for i, (status, part) in enumerate(self._failures):
            if part in path:
                del self._failures[i]
                return status
        return 403 if any(part in path for part in self.forbidden_paths) else None

    def fail_next(self, count: int, status: int = 500, path_part: str = "") -> None:
        """The next ``count`` requests (whose path holds ``path_part``) answer ``status``."""
        self._failures.extend([(status, path_part)] * count)

    def hold(self) -> None:
        """Hang every request (a stuck API server) until :meth:`release`."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()


class KubeApiDouble(CollectionReads, ObjectWrites, Faults):
    """An API server over HTTP(S) for tests: the verbs, binding, apply, logs, discovery."""

    def __init__(self) -> None:
        CollectionReads.__init__(self)
        Faults.__init__(self)
        self._server: ThreadingHTTPServer | None = None
        self._scheme = "http"
        #: The group/versions served (drop one to play an older cluster).
        self.groups = dict(GROUPS)

    # ------------------------------------------------------------------ control
    def start(self, tls: ssl.SSLContext | None = None) -> str:
        """Serve on 127.0.0.1 (HTTPS with the server context ``tls``); the base URL."""
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # kept-alive connections and chunked watches
            # An answer goes out as two writes (headers, body): with Nagle's algorithm the
            # body waits for the client's delayed ACK, 40 ms a request, as no real API
            # server makes anyone wait.
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                double._handle(self)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._scheme = "https" if tls is not None else "http"
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"{self._scheme}://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._open.set()  # held requests end
        with self._lock:
            self._stopping = True
            self._changed.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def kubeconfig(
        self,
        path: Path,
        cluster: dict[str, Any] | None = None,
        user: dict[str, Any] | None = None,
    ) -> Path:
        """A kubeconfig for this double; ``cluster``/``user`` add to (or replace) the
        defaults (the server URL, a bearer token)."""
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "double",
                    "clusters": [
                        {"name": "double", "cluster": {"server": self.url, **(cluster or {})}}
                    ],
                    "users": [
                        {
                            "name": "tester",
                            "user": user if user is not None else {"token": "test-token"},
                        }
                    ],
                    "contexts": [
                        {"name": "double", "context": {"cluster": "double", "user": "tester"}}
                    ],
                }
            )
        )
        return path

    # ------------------------------------------------------------------ serving

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        if not self._open.is_set():
            with self._lock:
                self.held_paths.append(urlparse(request.path).path)
        self._open.wait()
        parsed = urlparse(request.path)
        raw = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        content_type = request.headers.get("Content-Type", "")
        body: Any = None
        if raw:
            body = yaml.safe_load(raw) if "yaml" in content_type else json.loads(raw)
        query = parse_qs(parsed.query)
        with self._lock:
            self.requests.append(
                Recorded(
                    request.command,
                    parsed.path,
                    query,
                    content_type,
                    body,
                    request.headers.get("Authorization", ""),
                    bool(getattr(request.connection, "getpeercert", lambda: None)()),
                    accept=request.headers.get("Accept", ""),
                    port=int(request.client_address[1]),
                )
            )
            failure = self._next_failure(parsed.path)
        if failure is not None:
            return self._reply(request, failure, _status(failure, "injected failure"))
        if request.command == "GET" and (query.get("watch") or [""])[0] in ("1", "true"):
            return self._watch(request, parsed.path, query)
        if request.command == "GET" and parsed.path.rstrip("/").split("/")[-1] in KINDS:
            return self._list(request, parsed.path, query)
        version = parsed.path.rstrip("/").removeprefix("/apis/").removeprefix("/api/")
        if request.command == "GET" and version in GROUPS:
            if version not in self.groups:
                return self._reply(request, 404, _status(404, "the server could not find it"))
            resources = [{"name": p, "kind": KINDS[p]} for p in self.groups[version]]
            listing = {"kind": "APIResourceList", "groupVersion": version, "resources": resources}
            return self._reply(request, 200, listing)
        if request.command == "GET" and parsed.path.endswith("/log"):
            return self._log(request, parsed.path.rstrip("/").rsplit("/", 1)[0])
        with self._lock:
            status, answer = self._dispatch(request.command, parsed.path, query, content_type, body)
        self._reply(request, status, answer)


def main() -> None:
    """``python -m gpushare.sim.apidouble``: serve the double on 127.0.0.1, print its URL,
    and stop when standard input closes (``make bench`` runs it in its own process)."""
    import sys

    double = KubeApiDouble()
    print(double.start(), flush=True)
    sys.stdin.read()
    double.stop()


if __name__ == "__main__":
    main()
