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

Day two follows on the same install, in file order: the daemon's pod deleted, a rolling
update (``maxSurge: 1`` on 1.37), `kubectl gpushare verify` (no pod network for its pod: its
verdict is that no probe could run, from the kubelet's repeated sandbox failures), and last
the uninstall while a GPU pod runs (the host directory keeps exactly what it holds).
"""

from __future__ import annotations

import os
import re
import threading
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
    K8S_VERSION,
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
        try:
            yield c
        finally:
            keep_daemon_logs(c)


def keep_daemon_logs(cluster: Cluster) -> None:
    """The daemon pods' logs (in the node's /var/log/pods, gone with its namespace) beside
    the node's other logs, for e2e/logs/shipped-cluster."""
    for pod in daemon_pods(cluster):
        name = pod["metadata"]["name"]
        for container in ("cache-fs", "gpushare"):
            try:
                text = cluster.pod_log(NS, name, container)
            except Exception as exc:  # a log that cannot be read is said in its place
                text = f"(not read: {exc})\n"
            (cluster.nodes[NODE].dir / f"pod-{name}-{container}.log").write_text(text)


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


def visible_card(cluster: Cluster, pod: str) -> str:
    return environ(cluster.wait_report("default", pod, "main"))["NVIDIA_VISIBLE_DEVICES"]


def test_killing_the_daemon_pod_keeps_running_containers_and_admits_after_return(
    shipped: Cluster,
) -> None:
    """Day two (issue 39 item 5): the daemon's pod deleted as an operator would (`kubectl
    delete pod`). The GPU container running meanwhile is not touched (same container, no
    restart, the library file it mounts still there); the DaemonSet's next pod registers
    again, and its first placement respects the running container: a pod asking a whole
    card's 16 units gets the OTHER card."""
    old = ready_daemon_pod(shipped)
    shipped.create_pod(pod_manifest("kept", {MEMORY: 4, CORE: 30}, node=NODE, report=True))
    try:
        shipped.wait_pod("default", "kept", "Running")
        kept_card = visible_card(shipped, "kept")
        (before,) = (shipped.pod("default", "kept") or {})["status"]["containerStatuses"]
        libraries = {p.name for p in shipped.nodes[NODE].vgpu.glob("libvgpu.so*")}
        run(shipped, "-n", NS, "delete", "pod", old["metadata"]["name"], "--wait=true")
        new = ready_daemon_pod(shipped)
        assert new["metadata"]["uid"] != old["metadata"]["uid"]
        shipped.wait_allocatable(NODE, lambda a: int(a.get(MEMORY, 0)) == UNITS)
        (after,) = (shipped.pod("default", "kept") or {})["status"]["containerStatuses"]
        assert after["containerID"] == before["containerID"] and after["restartCount"] == 0
        assert "running" in after["state"], after
        assert libraries <= {p.name for p in shipped.nodes[NODE].vgpu.glob("libvgpu.so*")}
        shipped.create_pod(pod_manifest("after", {MEMORY: 16, CORE: 50}, node=NODE, report=True))
        try:
            shipped.wait_pod("default", "after", "Running")
            assert visible_card(shipped, "after") not in ("", kept_card)
        finally:
            shipped.delete_pod("default", "after")
    finally:
        shipped.delete_pod("default", "kept")


def test_verify_on_a_node_where_no_probe_can_run_ends_in_its_verdict(shipped: Cluster) -> None:
    """`kubectl gpushare verify` on the simulated node (docs/operations.md, "Verify on your
    node"). Its pod is not on the host network and these nodes have no pod network, so
    containerd cannot create its sandbox ('failed to find network info for sandbox' with
    Debian's loopback plugin; 'failed to find plugin "loopback"' without), again at each of
    the kubelet's tries: the pod's events say so, and verify ends in the verdict of a node
    where no probe could run (exit 3, the kubelet's reason) once the kubelet has failed twice,
    not after its 300 s wait (which would print "did not finish within")."""
    ready_daemon_pod(shipped)
    started = time.monotonic()
    done = shipped.kubectl_gpushare("verify", "--node", NODE)
    print(f"verify took {time.monotonic() - started:.0f} s")
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert "the pod cannot run: FailedCreatePodSandBox (" in out, out
    assert "did not finish within" not in out, out
    assert "deleted pod default/gpushare-verify-" in out, out


class AllocatableWatch:
    """The node's allocatable vcuda-memory, read from the API server until stopped: the
    smallest value seen (the kubelet's node status, which it updates within seconds of a
    device plugin's endpoint going or coming)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.seen: list[int] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(0.2):
            self.seen.append(int(self.cluster.allocatable(NODE).get(MEMORY, 0)))

    def stop(self) -> list[int]:
        self.stopped.set()
        self.thread.join()
        return self.seen


def test_a_rolling_update_leaves_gpu_pods_alone_and_the_new_daemon_owns_the_node(
    shipped: Cluster,
) -> None:
    """Day two (issue 39 item 5): a DaemonSet update while a GPU pod runs. On 1.37 with
    ``maxSurge: 1, maxUnavailable: 0`` (the kubelet keys device-plugin endpoints by socket
    path, kubernetes#135437; the daemon's sockets are named per instance): the new daemon
    registers beside the old one, and the node's allocatable never drops to 0. On 1.36 the
    manifest's strategy (``maxUnavailable: 1``). Either way the GPU pod is not disturbed and
    the new daemon alone serves the node afterwards. The template change is the metrics
    port: on the host network (the e2e's TEST-ONLY overlay) two pods of one node need two
    ports, which a pod network would not."""
    old = ready_daemon_pod(shipped)
    shipped.create_pod(pod_manifest("rolled", {MEMORY: 4, CORE: 30}, node=NODE, report=True))
    try:
        shipped.wait_pod("default", "rolled", "Running")
        card = visible_card(shipped, "rolled")
        (before,) = (shipped.pod("default", "rolled") or {})["status"]["containerStatuses"]
        port = free_port()
        container = "/spec/template/spec/containers/0"
        args = old["spec"]["containers"][0]["args"]
        ops: list[dict[str, Any]] = [
            {"op": "replace", "path": f"{container}/args",
             "value": [a for a in args if not a.startswith("--metrics-port=")]
             + [f"--metrics-port={port}"]},
            {"op": "replace", "path": f"{container}/ports/0/containerPort", "value": port},
        ]  # fmt: skip
        surge = K8S_VERSION != "1.36"
        if surge:
            ops.append(
                {"op": "replace", "path": "/spec/updateStrategy/rollingUpdate",
                 "value": {"maxSurge": 1, "maxUnavailable": 0}}
            )  # fmt: skip
        watch = AllocatableWatch(shipped)
        try:
            run(shipped, "-n", NS, "patch", "daemonset/gpushare", "--type=json",
                "-p", yaml.safe_dump(ops))  # fmt: skip

            def rolled() -> dict[str, Any] | None:
                pods = daemon_pods(shipped)
                (pod,) = pods if len(pods) == 1 else (None,)
                if pod is None or pod["metadata"]["uid"] == old["metadata"]["uid"]:
                    return None
                statuses = pod.get("status", {}).get("containerStatuses") or []
                return pod if statuses and all(x.get("ready") for x in statuses) else None

            new = wait_for("the rollout: one new daemon pod, Ready", rolled, 240, step=0.5)
            shipped.wait_allocatable(NODE, lambda a: int(a.get(MEMORY, 0)) == UNITS)
        finally:
            seen = watch.stop()
        print(f"allocatable vcuda-memory during the rollout: min {min(seen)}, {len(seen)} reads")
        if surge:
            assert seen and min(seen) > 0, seen
        assert f"--metrics-port={port}" in new["spec"]["containers"][0]["args"]
        # each daemon instance named its sockets for itself: the new daemon's alone are
        # left (one token, one socket per resource), and the kubelet never refused a
        # registration ("device plugin already connected": a path taken twice)
        agent = shipped.nodes[NODE]
        ours = sorted(p.name for p in (agent.root / "device-plugins").glob("gpushare-*.sock"))
        named = [re.fullmatch(r"gpushare-vcuda-(?:memory|core)\.([0-9a-f]{6})(?:-\d+)?\.sock", n)
                 for n in ours]  # fmt: skip
        tokens = {m.group(1) for m in named if m is not None}
        assert len(ours) == 2 and None not in named and len(tokens) == 1, ours
        kubelet_log = (agent.dir / "kubelet.log").read_text(errors="replace")
        assert "already connected" not in kubelet_log
        (after,) = (shipped.pod("default", "rolled") or {})["status"]["containerStatuses"]
        assert after["containerID"] == before["containerID"] and after["restartCount"] == 0
        # the new daemon alone serves the node: a whole card's units go to the other card
        shipped.create_pod(pod_manifest("rolled-2", {MEMORY: 16, CORE: 50}, node=NODE, report=True))
        try:
            shipped.wait_pod("default", "rolled-2", "Running")
            assert visible_card(shipped, "rolled-2") not in ("", card)
        finally:
            shipped.delete_pod("default", "rolled-2")
    finally:
        shipped.delete_pod("default", "rolled")


def test_uninstall_leaves_nothing_in_the_cluster_and_no_socket_or_spec_on_the_node(
    shipped: Cluster,
) -> None:
    """Day two (issue 39 item 5), last in this module: docs/deploy.md's uninstall of an
    install made with `kubectl apply -k`: `kubectl gpushare uninstall --all` (unlabels the
    node, waits for the pod to go, removes what the daemon published on the Node and its
    state object; it deletes only objects it created itself, none here), then `kubectl
    delete -k` of what was applied, while one GPU pod runs on. Nothing of gpushare is left
    in the cluster; on the node no socket of the plugin in the kubelet's device-plugins/,
    no CDI spec, and in the host directory exactly what the running container holds: its
    cache directory and record, the lock directory, the library version and preload file
    (and memory hook) it may map, the unit file, and the cache tmpfs, emptied of the
    rest (kept mounted by uninstall's host cleanup pod, which the running container
    holds). After that pod ends, uninstall again finishes the job."""
    ready_daemon_pod(shipped)
    shipped.create_pod(pod_manifest("stays", {MEMORY: 4, CORE: 30}, node=NODE, report=True))
    try:
        shipped.wait_pod("default", "stays", "Running")
        _uninstall_and_check(shipped)
    finally:
        shipped.delete_pod("default", "stays")
    # the pod ended: uninstall again (the Node's record of the unfinished host cleanup
    # names it for --all) finishes the job: the tmpfs unmounted, only the test's node file
    # left in the host directory, the record gone (test_uninstall_real.py: the whole host)
    done = shipped.kubectl_gpushare("uninstall", "--all", "--wait", "120")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"cleaning the host of {NODE}" in done.stdout, done.stdout
    holder = shipped.nodes[NODE].holder
    assert holder is not None
    host_lib = Path(f"/proc/{holder.pid}/root{HOST_LIB_DIR}")
    assert {str(p.relative_to(host_lib)) for p in host_lib.rglob("*")} == {"test", "test/node.yaml"}
    mountinfo = Path(f"/proc/{holder.pid}/mountinfo").read_text().splitlines()
    assert not [line for line in mountinfo if line.split()[4].startswith(f"{HOST_LIB_DIR}/")]
    annotations = shipped.node(NODE)["metadata"].get("annotations") or {}
    assert not [k for k in annotations if k.startswith(PREFIX)], annotations


def _uninstall_and_check(shipped: Cluster) -> None:
    done = shipped.kubectl_gpushare("uninstall", "--all", "--wait", "120")
    assert done.returncode == 0, done.stdout + done.stderr
    wait_for("the daemon's pod to go", lambda: not daemon_pods(shipped) or None, 120)
    run(shipped, "delete", "-k", str(shipped.dir / "overlay"), "--wait=true")
    node = shipped.node(NODE)
    assert not [k for k in node["metadata"].get("labels", {}) if k.startswith(PREFIX)], node
    # the one annotation left: the record of the host cleanup unfinished (a GPU pod runs)
    annotations = node["metadata"].get("annotations", {})
    assert [k for k in annotations if k.startswith(PREFIX)] == [f"{PREFIX}/host-cleanup"]
    # the plugin's devices go from the node's allocatable at the kubelet's next node
    # status (every 2 s here) after its last endpoint ended: the daemon's pod can be gone
    # from the API server before that (seen once in 8 runs on 1.37), so wait for it
    started = time.monotonic()
    shipped.wait_allocatable(
        NODE, lambda a: all(int(v) == 0 for k, v in a.items() if k.startswith(PREFIX)), 60
    )
    print(f"allocatable 0 {time.monotonic() - started:.1f} s after the uninstall")
    for path in (
        DS,
        f"/api/v1/namespaces/{NS}/serviceaccounts/gpushare",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles/gpushare",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/gpushare",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/gpushare",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/gpushare",
        f"/api/v1/namespaces/{NS}/configmaps/gpushare-node-{NODE}",
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
        "/gpushare-core-needs-memory",
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
        "/gpushare-daemon-node-scope",
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
        "/gpushare-reserved-settings",
    ):
        assert shipped.api.get_or_none(path) is None, path
    agent = shipped.nodes[NODE]
    sockets = sorted(p.name for p in (agent.root / "device-plugins").glob("*.sock"))
    assert sockets == ["kubelet.sock"], sockets
    assert not list(agent.cdi_dir.glob("*")), list(agent.cdi_dir.glob("*"))
    # /usr/local/vgpu as the node sees it (through its namespace holder's root)
    assert agent.holder is not None
    host_lib = Path(f"/proc/{agent.holder.pid}/root{HOST_LIB_DIR}")
    left = {str(p.relative_to(host_lib)) for p in host_lib.rglob("*")}
    left = {p for p in left if not p.startswith("test")}
    mountinfo = Path(f"/proc/{agent.holder.pid}/mountinfo").read_text().splitlines()
    mounts = [line.split()[4] for line in mountinfo if line.split()[4].startswith(HOST_LIB_DIR)]
    assert [m for m in mounts if m != HOST_LIB_DIR] == [f"{HOST_LIB_DIR}/containers"], mounts
    caches = sorted(p for p in left if p.startswith("containers/c-") and "." not in p)
    assert len(caches) == 1, f"one running container, one cache directory: {sorted(left)}"
    libraries = [p for p in left if p.startswith("libvgpu.so.")]
    assert len(libraries) == 1, f"one library version (the current one): {sorted(left)}"
    version = libraries[0].rsplit(".", 1)[1]
    hooks = {p for p in left if p.startswith("gpushare-memory-hook.")}
    maybe = {f"ld.so.preload.{version}"} | hooks
    assert left - maybe == {
        "containers",
        "containers/vgpulock",
        caches[0],
        f"{caches[0]}.json",
        "memory-unit.json",
        libraries[0],
    }, sorted(left)
