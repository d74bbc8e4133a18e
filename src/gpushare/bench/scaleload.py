"""The real API server of ``make scale``: etcd and kube-apiserver (``e2e/bin``, the ones
``make e2e`` builds; started by :mod:`gpushare.sim.controlplane`, as the DRA tests and
``make bench`` do), loaded with fake Nodes, their state objects and bound Pods.

No kubelet runs: a Node is created with its status as a kubelet registers it (and the
daemon's card-state annotation, ``nodestate.encode``), its ConfigMap
``gpushare-node-<node>`` in ``kube-system`` (:mod:`gpushare.kube.stateobject`, owned by
the Node's UID, as a daemon in mode ``both`` publishes it), and each Pod is created
already bound (``spec.nodeName``; a GPU pod with the extender's plan and the daemon's
card annotation). The API server sets a created Pod's status to Pending; with
``status=True`` each Pod's status is then written as the kubelet would (Running, its
container's state), one more write per pod.

The objects are written by a pool of threads over kept-alive connections (the API
server's own limit, 400 requests in flight, is far away); each load step reports how
long it took, so the table says what building the set-up cost.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpushare.bench.scaleobjects import (
    POD_TEXT,
    PREFIX,
    card_state_text,
    gpu_node,
    node_name,
    pod_fields,
)
from gpushare.kube import stateobject
from gpushare.kube.stdlibclient import MERGE_PATCH, ApiClient, ApiStatusError
from gpushare.sim import controlplane

NAMESPACES = 50
STATE_NAMESPACE = "kube-system"
WORKERS = 24
#: etcd's default quota (2 GiB) is near at 150 000 pods with their status writes
ETCD_QUOTA = str(16 << 30)
SERVER_SET = ("uid", "resourceVersion", "creationTimestamp", "managedFields")


def _for_create(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without what the API server sets itself."""
    meta = obj["metadata"]
    for key in SERVER_SET:
        meta.pop(key, None)
    return obj


class RealCluster:
    """etcd and kube-apiserver on loopback, and the loaded objects; :meth:`stop` ends it."""

    def __init__(self, root: Path, bin_dir: Path = controlplane.BIN) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.plane = controlplane.ControlPlane(
            root,
            {},
            bin_dir,
            node="node-00000",
            etcd_flags=("--quota-backend-bytes", ETCD_QUOTA),
        )
        self.server = f"https://127.0.0.1:{self.plane.port}"
        self.ca = self.plane.ca
        self.token_file = root / "admin.token"
        self.token_file.write_text(self.plane.admin_token)
        self.api: ApiClient = self.plane.admin
        self.nodes = 0
        self.pods = 0
        self.node_uids: dict[int, str] = {}
        self._uid_lock = threading.Lock()
        for index in range(NAMESPACES):
            self._create_namespace(f"team-{index}")

    def _create_namespace(self, name: str) -> None:
        self._create("/api/v1/namespaces", {"metadata": {"name": name}})
        # no controller manager: the ServiceAccount admission wants the pods' account
        self._create(
            f"/api/v1/namespaces/{name}/serviceaccounts", {"metadata": {"name": "default"}}
        )

    def _create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body``; an object that already exists (a retried request) is fine."""
        for attempt in range(5):
            try:
                answer = self.api.request("POST", path, body=body, timeout=60.0)
                return answer if isinstance(answer, dict) else {}
            except ApiStatusError as exc:
                if exc.status == 409:
                    return {}
                if exc.status not in (429, 500, 503, 504) or attempt == 4:
                    raise
            except OSError:
                if attempt == 4:
                    raise
            time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")  # pragma: no cover

    def _parallel(self, work: Callable[[int], None], indexes: Iterable[int]) -> float:
        started = time.perf_counter()
        with ThreadPoolExecutor(WORKERS) as pool:
            for _ in pool.map(work, indexes):
                pass
        return time.perf_counter() - started

    # ------------------------------------------------------------------ nodes
    def _add_node(self, index: int) -> None:
        node = _for_create(gpu_node(index))
        created = self._create("/api/v1/nodes", node)
        uid = str((created.get("metadata") or {}).get("uid") or "")
        if not uid:  # created by an earlier try of this request
            uid = str(self.api.get(f"/api/v1/nodes/{node_name(index)}")["metadata"]["uid"])
        # kube-apiserver's TaintNodesByCondition tainted it not-ready; no kubelet or
        # node lifecycle controller lifts it here, and the extender reads no taints
        state = stateobject.state_object(
            PREFIX, STATE_NAMESPACE, node_name(index), uid, card_state_text(index)
        )
        self._create(stateobject.configmaps_path(STATE_NAMESPACE), state)

    def grow_nodes(self, total: int) -> float:
        """Nodes (with their state objects) up to ``total``; the seconds it took."""
        seconds = self._parallel(self._add_node, range(self.nodes, total))
        self.nodes = max(self.nodes, total)
        return seconds

    # ------------------------------------------------------------------ pods
    def _add_pod(self, index: int, status: bool) -> None:
        gpu = index % 4 == 0
        pod = _for_create(json.loads(POD_TEXT[gpu] % pod_fields(index, self.nodes)))
        wanted = pod.pop("status")
        namespace = pod["metadata"]["namespace"]
        self._create(f"/api/v1/namespaces/{namespace}/pods", pod)
        if status:
            self.api.request(
                "PATCH",
                f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}/status",
                body={"status": wanted},
                content_type=MERGE_PATCH,
                timeout=60.0,
            )

    def grow_pods(self, total: int, status: bool = True) -> float:
        """Bound pods (one in four asking for GPU units) up to ``total``, over the nodes
        made so far; the seconds it took."""
        if self.nodes == 0:
            raise ValueError("pods need nodes to be bound to")
        seconds = self._parallel(lambda i: self._add_pod(i, status), range(self.pods, total))
        self.pods = max(self.pods, total)
        return seconds

    def stop(self) -> None:
        self.plane.stop()
