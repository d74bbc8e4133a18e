"""The few API server calls ``kubectl gpushare`` makes, as plain JSON.

Objects are read, server-side applied and deleted by kind through REST paths, sent by
the ``kubernetes`` package's ``ApiClient`` (kubeconfig, authentication, TLS). Its typed
API classes are never touched: ``CoreV1Api`` alone imports some 250 model classes (about
1.1 s of a 1.5 s ``inspect``), so answers are the server's JSON and nothing here depends
on the client's models. Every failure becomes one
readable line: :class:`NoCluster` when there is no usable kubeconfig
or the server cannot be reached, :class:`ApiError` when it answered with an error.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

FIELD_MANAGER = "kubectl-gpushare"
TIMEOUT_SECONDS = 15

#: (apiVersion, kind) -> (collection path, namespaced)
KINDS: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "ServiceAccount"): ("/api/v1/namespaces/{namespace}/serviceaccounts", True),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): (
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        False,
    ),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): (
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        False,
    ),
    # the daemon's state object: its Role in its namespace
    ("rbac.authorization.k8s.io/v1", "Role"): (
        "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
        True,
    ),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): (
        "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
        True,
    ),
    ("v1", "ConfigMap"): ("/api/v1/namespaces/{namespace}/configmaps", True),
    ("apps/v1", "DaemonSet"): ("/apis/apps/v1/namespaces/{namespace}/daemonsets", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): (
        "/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
        True,
    ),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
        False,
    ),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
        False,
    ),
    ("v1", "Pod"): ("/api/v1/namespaces/{namespace}/pods", True),
    # kubectl gpushare verify under the driver memory backend
    ("resource.k8s.io/v1", "ResourceClaim"): (
        "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims",
        True,
    ),
}


#: Exit status of every ``kubectl gpushare`` command without a usable cluster.
EXIT_NO_CLUSTER = 2


class NoCluster(Exception):
    """No kubeconfig, or the API server cannot be reached."""


class ApiError(Exception):
    """The API server answered a request with an error status."""


def root_cause(exc: BaseException) -> str:
    """The innermost OS error of a chain (``[Errno 111] Connection refused``), else ``exc``."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    found: OSError | None = None
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            found = current
        for linked in (getattr(current, "reason", None), current.__cause__, current.__context__):
            if isinstance(linked, BaseException):
                todo.append(linked)
    if found is not None:
        return f"[Errno {found.errno}] {found.strerror}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def describe(obj: Mapping[str, Any]) -> str:
    """``DaemonSet kube-system/gpushare`` or ``ClusterRole gpushare``."""
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    name = f"{namespace}/{meta.get('name')}" if namespace else str(meta.get("name"))
    return f"{obj.get('kind')} {name}"


def _check_readable(path: str) -> None:
    """NoCluster naming the file when none of ``path``'s files (``KUBECONFIG`` may list
    several) can be read: the client's own message does not name it."""
    files = [os.path.expanduser(p) for p in path.split(os.pathsep) if p]
    errors = []
    for file in files:
        try:
            with open(file, "rb"):
                return
        except OSError as exc:
            errors.append(f"{file}: {exc.strerror or exc}")
    raise NoCluster(f"no usable kubeconfig: {'; '.join(errors) or 'empty path'}")


class Cluster:
    """The current kubeconfig's cluster (or the in-cluster one)."""

    def __init__(self, kubeconfig: str | None = None, context: str | None = None) -> None:
        """``kubeconfig`` and ``context`` as kubectl's flags: the file (else $KUBECONFIG,
        else ~/.kube/config; in a pod without either, the service account) and the
        context in it (else its current context).

        With the ``kubernetes`` package (an installed plugin) every kind of kubeconfig
        credential works; without it (the single-file plugin, ``make kubectl-plugin``) the
        standard-library client of :mod:`gpushare.kube.stdlibclient` is used: tokens and
        client certificates, no exec or auth-provider plugins."""
        self._api_client: Any = None
        self._plain: Any = None
        in_cluster = not (kubeconfig or context or os.environ.get("KUBECONFIG"))
        try:
            from kubernetes import client, config
        except ImportError:
            self._connect_plain(kubeconfig, context, in_cluster)
            return
        configuration = client.Configuration()
        path = "(in-cluster service account)"
        try:
            if in_cluster and os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            else:
                path = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
                _check_readable(path)
                config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=path, context=context, client_configuration=configuration
                )
        except NoCluster:
            raise
        except Exception as exc:
            raise NoCluster(f"no usable kubeconfig: {path}: {exc}") from None
        configuration.retries = 1
        self._api_client = client.ApiClient(configuration)
        self._host = configuration.host

    def _connect_plain(self, kubeconfig: str | None, context: str | None, in_cluster: bool) -> None:
        from pathlib import Path

        from gpushare.kube.stdlibclient import (
            ApiClient,
            KubeConfigError,
            in_cluster_endpoint,
            kubeconfig_endpoint,
        )

        try:
            if in_cluster and os.environ.get("KUBERNETES_SERVICE_HOST"):
                endpoint = in_cluster_endpoint(os.environ)
            else:
                paths = (kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config").split(
                    os.pathsep
                )
                endpoint = kubeconfig_endpoint(Path(paths[0]).expanduser(), context)
        except KubeConfigError as exc:
            raise NoCluster(f"no usable kubeconfig: {exc}") from None
        self._plain = ApiClient(endpoint)
        self._host = endpoint.describe()

    # ------------------------------------------------------------------ plumbing
    def _call(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        raw: bool = False,
    ) -> Any:
        """One request; the answer's JSON (``raw``: its text), or None for 404 Not Found."""
        if self._plain is not None:
            return self._call_plain(method, path, query, body, content_type, raw)
        api = self._api_client
        headers = {"Accept": "*/*" if raw else "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            request = api.param_serialize(
                method,
                path,
                query_params=[(k, v) for k, v in (query or {}).items() if v != ""],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = api.call_api(*request, _request_timeout=TIMEOUT_SECONDS)
            response.read()
        except Exception as exc:
            raise NoCluster(
                f"cannot reach the API server at {self._host}: {root_cause(exc)}"
            ) from None
        if response.status == 404:
            return None
        if response.status >= 400:
            raise ApiError(_api_message(response.status, response.reason, response.data))
        data = response.data
        if raw:
            return data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
        return json.loads(data) if data else {}

    def _call_plain(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None,
        body: Any,
        content_type: str,
        raw: bool,
    ) -> Any:
        import http.client

        from gpushare.kube.stdlibclient import ApiStatusError, KubeConfigError

        try:
            return self._plain.request(
                method,
                path,
                query={k: v for k, v in (query or {}).items() if v != ""} or None,
                body=body,
                content_type=content_type,
                timeout=TIMEOUT_SECONDS,
                raw=raw,
            )
        except ApiStatusError as exc:
            if exc.status == 404:
                return None
            raise ApiError(str(exc)) from None
        except (OSError, http.client.HTTPException, KubeConfigError) as exc:
            raise NoCluster(
                f"cannot reach the API server at {self._host}: {root_cause(exc)}"
            ) from None

    def _path(self, obj: Mapping[str, Any]) -> str:
        key = (str(obj.get("apiVersion")), str(obj.get("kind")))
        if key not in KINDS:
            raise ApiError(f"kubectl-gpushare does not handle {key[1]} of {key[0]}")
        collection, namespaced = KINDS[key]
        meta = obj["metadata"]
        if namespaced:
            collection = collection.format(namespace=quote(str(meta["namespace"]), safe=""))
        return f"{collection}/{quote(str(meta['name']), safe='')}"

    def serves(self, obj: Mapping[str, Any]) -> bool:
        """Whether the API server serves ``obj``'s kind at its apiVersion (discovery)."""
        version = str(obj.get("apiVersion"))
        path = "/api/v1" if version == "v1" else f"/apis/{version}"
        answer = self._call("GET", path) or {}
        return any(r.get("kind") == obj.get("kind") for r in answer.get("resources") or [])

    # ------------------------------------------------------------------ objects
    def read(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """The object as stored, or None when it does not exist."""
        result: dict[str, Any] | None = self._call("GET", self._path(obj))
        return result

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` as field manager ``kubectl-gpushare``."""
        result: dict[str, Any] = self._call(
            "PATCH",
            self._path(obj),
            {"fieldManager": FIELD_MANAGER, "force": "true"},
            dict(obj),
            "application/apply-patch+yaml",
        )
        return result

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``obj`` to its collection (an error if it exists)."""
        collection = self._path(obj).rsplit("/", 1)[0]
        result: dict[str, Any] = self._call("POST", collection, body=dict(obj))
        return result

    def pod_log(self, namespace: str, name: str, limit_bytes: int = 1 << 20) -> str | None:
        """The pod's (only) container's log, at most ``limit_bytes``; None if gone."""
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}/log"
        result: str | None = self._call("GET", path, {"limitBytes": str(limit_bytes)}, raw=True)
        return result

    def delete(self, obj: Mapping[str, Any]) -> bool:
        """Delete the object; False when it was already gone."""
        return (
            self._call("DELETE", self._path(obj), {"propagationPolicy": "Background"}) is not None
        )

    # ------------------------------------------------------------------ nodes
    def nodes(self, label_selector: str = "") -> list[dict[str, Any]]:
        answer = self._call("GET", "/api/v1/nodes", {"labelSelector": label_selector})
        return list((answer or {}).get("items") or [])

    def configmaps(self, label_selector: str = "") -> list[dict[str, Any]]:
        """ConfigMaps of every namespace."""
        answer = self._call("GET", "/api/v1/configmaps", {"labelSelector": label_selector})
        return list((answer or {}).get("items") or [])

    def pods(self, field_selector: str = "", label_selector: str = "") -> list[dict[str, Any]]:
        """Pods of every namespace."""
        answer = self._call(
            "GET",
            "/api/v1/pods",
            {"fieldSelector": field_selector, "labelSelector": label_selector},
        )
        return list((answer or {}).get("items") or [])

    def events(self, namespace: str, field_selector: str = "") -> list[dict[str, Any]]:
        """Events (core v1) of one namespace, e.g. ``involvedObject.uid=...``."""
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/events"
        answer = self._call("GET", path, {"fieldSelector": field_selector})
        return list((answer or {}).get("items") or [])

    def resource_claims(self) -> list[dict[str, Any]] | None:
        """ResourceClaims (resource.k8s.io/v1) of every namespace; None where not served."""
        answer = self._call("GET", "/apis/resource.k8s.io/v1/resourceclaims")
        return None if answer is None else list(answer.get("items") or [])

    def node(self, name: str) -> dict[str, Any] | None:
        result: dict[str, Any] | None = self._call("GET", f"/api/v1/nodes/{quote(name, safe='')}")
        return result

    def patch_node_metadata(
        self,
        name: str,
        labels: Mapping[str, str | None],
        annotations: Mapping[str, str | None],
    ) -> None:
        """JSON merge patch of a node's labels and annotations (None removes a key)."""
        metadata: dict[str, Any] = {"labels": dict(labels)}
        if annotations:
            metadata["annotations"] = dict(annotations)
        self._call(
            "PATCH",
            f"/api/v1/nodes/{quote(name, safe='')}",
            body={"metadata": metadata},
            content_type="application/merge-patch+json",
        )


def _api_message(status: int, reason: str | None, body: bytes | str | None) -> str:
    """``403 Forbidden: nodes "a" is forbidden: ...`` from an error answer."""
    message = ""
    with contextlib.suppress(TypeError, ValueError, AttributeError):
        message = str(json.loads(body or b"").get("message") or "")
    text = f"{status} {reason or ''}".rstrip() + (f": {message}" if message else "")
    return text.replace("\n", " ")
