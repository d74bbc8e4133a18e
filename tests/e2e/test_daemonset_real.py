"""gpushare as a user deploys it (issue 39 items 3 and 5), on a cluster of its own whose one
node runs a real containerd and runc (tests/e2e/real_runtime.py) under its real kubelet.

The install is docs/deploy.md's, command for command (e2e/README.md, "The DaemonSet as
shipped"): the archive `make image-archive` writes (the session fixture ``gpushare_image``)
imported into the node's containerd, `kubectl apply -k` of ``daemonset/``, the TEST-ONLY
``GPUSHARE_SIMULATE`` set with `kubectl set env`, `kubectl label node`. The daemon then runs
as the DaemonSet's pod: its init container mounts the cache tmpfs through a Bidirectional
hostPath, the daemon container runs with the manifest's service account, capabilities,
read-only root and hostPaths, reads the simulated node file, installs the stub interposer
into the host directory and registers with the kubelet.

What differs from a production install, each forced by this machine and each written in
e2e/README.md and docs/deploy.md: ``kubectl apply -k`` is given a TEST-ONLY overlay of
``daemonset/`` (written by :func:`write_overlay`) that puts the pod on the host network
(this cluster has no pod network and no kube-proxy), points the in-cluster client at the
API server's own address (``KUBERNETES_SERVICE_HOST/PORT``: the ``kubernetes`` Service's
ClusterIP leads nowhere here) and moves the metrics port off 9445 to a free one bound on
127.0.0.1 (nodes and other checkouts share this machine's network); the node's
``/usr/local/vgpu`` is a shared bind mount of the node's directory in its mount namespace
(NodeSpec.host_lib_dir).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_nodes import CARD_4GIB, cards
from kube_cluster import (
    CORE,
    HOST_LIB_DIR,
    MEMORY,
    PREFIX,
    REPO,
    Cluster,
    NodeSpec,
    free_port,
    pod_manifest,
    running_cluster,
    wait_for,
)
from local_image import environ

NODE = "node-1"
NS = "kube-system"
DS = f"/apis/apps/v1/namespaces/{NS}/daemonsets/gpushare"
OPT_IN = f"{PREFIX}/enabled"
GPUS = cards(1, CARD_4GIB, 2)  # two 4 GiB cards: 16 units each
UNITS = 32
#: docs/deploy.md, "On a node without a GPU (TEST ONLY)": the node file's place on the node
SIMULATE = f"{HOST_LIB_DIR}/test/node.yaml"
SELECTOR = "app.kubernetes.io/name=gpushare"


def write_overlay(cluster: Cluster, metrics_port: int) -> Path:
    """The TEST-ONLY kustomize overlay of ``daemonset/`` (module docstring): everything else
    is the repository's manifest as shipped."""
    overlay = cluster.dir / "overlay"
    overlay.mkdir(exist_ok=True)
    container = "/spec/template/spec/containers/0"
    ops = [
        {"op": "add", "path": "/spec/template/spec/hostNetwork", "value": True},
        {"op": "add", "path": f"{container}/args/-", "value": "--metrics-address=127.0.0.1"},
        {"op": "add", "path": f"{container}/args/-", "value": f"--metrics-port={metrics_port}"},
        {"op": "replace", "path": f"{container}/ports/0/containerPort", "value": metrics_port},
        {"op": "add", "path": f"{container}/env/-",
         "value": {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"}},
        {"op": "add", "path": f"{container}/env/-",
         "value": {"name": "KUBERNETES_SERVICE_PORT", "value": str(cluster.api_port)}},
    ]  # fmt: skip
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "daemonset", overlay)],
        "patches": [
            {"target": {"kind": "DaemonSet", "name": "gpushare"}, "patch": yaml.safe_dump(ops)}
        ],
    }
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return overlay


def daemon_pods(cluster: Cluster) -> list[dict[str, Any]]:
    pods = cluster.api.get(f"/api/v1/namespaces/{NS}/pods", labelSelector=SELECTOR)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def ready_daemon_pod(cluster: Cluster, timeout: float = 180) -> dict[str, Any]:
    """The DaemonSet's one pod on the node, once its daemon container is Ready (the
    manifest's /readyz probe: the GPUs served and every resource registered)."""

    def ready() -> dict[str, Any] | None:
        for pod in daemon_pods(cluster):
            statuses = pod.get("status", {}).get("containerStatuses") or []
            if statuses and all(s.get("ready") for s in statuses):
                return pod
        return None

    return wait_for("the DaemonSet's pod Ready on the node", ready, timeout, step=0.5)


def run(cluster: Cluster, *args: str) -> str:
    done = cluster.kubectl(*args)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def shipped(gpushare_image: Path) -> Iterator[Cluster]:
    """The cluster, with gpushare installed as docs/deploy.md says (module docstring)."""
    spec = NodeSpec(NODE, GPUS, labels={}, runtime="containerd", host_lib_dir=True)
    with running_cluster(
        [spec], logs=REPO / "e2e" / "logs" / "shipped-cluster", install=False
    ) as c:
        agent = c.nodes[NODE]
        assert agent.containerd is not None
        # on the node: ctr -n k8s.io images import dist/gpushare-<version>-<arch>.tar
        started = time.monotonic()
        agent.containerd.import_image(gpushare_image, timeout=1200)
        print(f"image imported in {time.monotonic() - started:.0f} s")
        # on the node: the simulated node file under /usr/local/vgpu/test/ (TEST ONLY)
        (agent.vgpu / "test").mkdir(exist_ok=True)
        (agent.vgpu / "test" / "node.yaml").write_text(yaml.safe_dump({"gpus": GPUS}))
        run(c, "apply", "-k", str(write_overlay(c, free_port())))
        run(c, "-n", NS, "set", "env", "daemonset/gpushare", f"GPUSHARE_SIMULATE={SIMULATE}")
        run(c, "label", "node", NODE, f"{OPT_IN}=true")
        yield c


def test_the_daemonset_runs_as_shipped_and_registers(shipped: Cluster) -> None:
    pod = ready_daemon_pod(shipped)
    spec = pod["spec"]
    assert spec["nodeName"] == NODE and spec["serviceAccountName"] == "gpushare"
    (init,) = pod["status"]["initContainerStatuses"]
    assert init["name"] == "cache-fs"
    assert init["state"]["terminated"]["exitCode"] == 0, init
    (main,) = pod["status"]["containerStatuses"]
    assert main["image"].endswith("gpushare:0.1.0") or main["image"].startswith("sha256:"), main
    allocatable = shipped.wait_allocatable(NODE, lambda a: int(a.get(MEMORY, 0)) == UNITS)
    assert int(allocatable[CORE]) == 200
    agent = shipped.nodes[NODE]
    # the init container's tmpfs reached the node's namespace through the Bidirectional
    # hostPath (the node's mounts, as its holder process sees them)
    assert agent.holder is not None
    mountinfo = Path(f"/proc/{agent.holder.pid}/mountinfo").read_text().splitlines()
    cache_fs = [line for line in mountinfo if line.split()[4] == f"{HOST_LIB_DIR}/containers"]
    assert cache_fs and " - tmpfs " in cache_fs[0], mountinfo
    # the daemon in the image installed the interposer into the host directory
    assert any(p.name.startswith("libvgpu.so") for p in agent.vgpu.iterdir())
    # the daemon's own API writes went through its service account, RBAC and policies
    state = f"/api/v1/namespaces/{NS}/configmaps/gpushare-node-{NODE}"
    wait_for("the node's state object", lambda: shipped.api.get_or_none(state), 60)


def test_a_gpu_pod_runs_with_the_limits_of_the_shipped_daemon(shipped: Cluster) -> None:
    ready_daemon_pod(shipped)
    shipped.create_pod(pod_manifest("shipped-a", {MEMORY: 4, CORE: 30}, node=NODE, report=True))
    try:
        shipped.wait_pod("default", "shipped-a", "Running")
        env = environ(shipped.wait_report("default", "shipped-a", "main"))
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m", env
        assert env["CUDA_DEVICE_SM_LIMIT"] == "30", env
        assert env["NVIDIA_VISIBLE_DEVICES"] in {g["uuid"] for g in GPUS}, env
    finally:
        shipped.delete_pod("default", "shipped-a")
