"""The few API server calls ``kubectl gpushare`` makes, as plain JSON.

Objects are read, server-side applied and deleted by kind through the typed clients of
the ``kubernetes`` package; answers are kept as the server's JSON (``_preload_content``
off), so nothing here depends on the client's model classes. Every failure becomes one
readable line: :class:`NoCluster` when there is no usable kubeconfig
or the server cannot be reached, :class:`ApiError` when it answered with an error.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

FIELD_MANAGER = "kubectl-gpushare"
TIMEOUT_SECONDS = 15

#: (apiVersion, kind) -> (client class, method suffix, namespaced)
KINDS: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("v1", "ServiceAccount"): ("CoreV1Api", "namespaced_service_account", True),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): (
        "RbacAuthorizationV1Api",
        "cluster_role",
        False,
    ),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): (
        "RbacAuthorizationV1Api",
        "cluster_role_binding",
        False,
    ),
    ("apps/v1", "DaemonSet"): ("AppsV1Api", "namespaced_daemon_set", True),
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


class Cluster:
    """The current kubeconfig's cluster (or the in-cluster one)."""

    def __init__(self) -> None:
        try:
            from kubernetes import client, config
        except ImportError as exc:  # pragma: no cover - a dependency
            raise NoCluster(f"the kubernetes package is missing: {exc}") from None
        configuration = client.Configuration()
        try:
            if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            else:
                kubeconfig = os.environ.get("KUBECONFIG") or "~/.kube/config"
                config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=kubeconfig, client_configuration=configuration
                )
        except Exception as exc:
            raise NoCluster(f"no usable kubeconfig: {exc}") from None
        configuration.retries = 1
        self._client = client
        self._api_client = client.ApiClient(configuration)
        self._host = configuration.host
        self.core = client.CoreV1Api(self._api_client)

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` and return the answer's JSON; None for 404 Not Found."""
        try:
            response = method(
                *args, _preload_content=False, _request_timeout=TIMEOUT_SECONDS, **kwargs
            )
        except self._client.ApiException as exc:
            if exc.status == 404:
                return None
            raise ApiError(_api_message(exc)) from None
        except Exception as exc:
            raise NoCluster(
                f"cannot reach the API server at {self._host}: {root_cause(exc)}"
            ) from None
        data = response.data
        return json.loads(data) if data else {}

    def _method(self, obj: Mapping[str, Any], verb: str) -> tuple[Callable[..., Any], list[str]]:
        key = (str(obj.get("apiVersion")), str(obj.get("kind")))
        if key not in KINDS:
            raise ApiError(f"kubectl-gpushare does not handle {key[1]} of {key[0]}")
        class_name, suffix, namespaced = KINDS[key]
        api = getattr(self._client, class_name)(self._api_client)
        meta = obj["metadata"]
        args = [meta["name"], meta["namespace"]] if namespaced else [meta["name"]]
        return getattr(api, f"{verb}_{suffix}"), args

    # ------------------------------------------------------------------ objects
    def read(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """The object as stored, or None when it does not exist."""
        method, args = self._method(obj, "read")
        result: dict[str, Any] | None = self._call(method, *args)
        return result

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` as field manager ``kubectl-gpushare``."""
        method, args = self._method(obj, "patch")
        result: dict[str, Any] = self._call(
            method,
            *args,
            dict(obj),
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )
        return result

    def delete(self, obj: Mapping[str, Any]) -> bool:
        """Delete the object; False when it was already gone."""
        method, args = self._method(obj, "delete")
        return self._call(method, *args, propagation_policy="Background") is not None

    # ------------------------------------------------------------------ nodes
    def nodes(self, label_selector: str = "") -> list[dict[str, Any]]:
        answer = self._call(self.core.list_node, label_selector=label_selector)
        return list((answer or {}).get("items") or [])

    def pods(self, field_selector: str = "", label_selector: str = "") -> list[dict[str, Any]]:
        """Pods of every namespace."""
        answer = self._call(
            self.core.list_pod_for_all_namespaces,
            field_selector=field_selector,
            label_selector=label_selector,
        )
        return list((answer or {}).get("items") or [])

    def node(self, name: str) -> dict[str, Any] | None:
        result: dict[str, Any] | None = self._call(self.core.read_node, name)
        return result

    def patch_node_metadata(
        self, name: str, labels: Mapping[str, str | None], annotations: Mapping[str, None]
    ) -> None:
        """JSON merge patch of a node's labels and annotations (None removes a key)."""
        metadata: dict[str, Any] = {"labels": dict(labels)}
        if annotations:
            metadata["annotations"] = dict(annotations)
        self._call(
            self.core.patch_node,
            name,
            {"metadata": metadata},
            _content_type="application/merge-patch+json",
        )


def _api_message(exc: Any) -> str:
    """``403 Forbidden: nodes "a" is forbidden: ...`` from an ApiException."""
    message = ""
    with contextlib.suppress(TypeError, ValueError, AttributeError):
        message = str(json.loads(exc.body).get("message") or "")
    text = f"{exc.status} {exc.reason}" + (f": {message}" if message else "")
    return text.replace("\n", " ")
