"""`kubectl gpushare uninstall` leaves nothing of gpushare on the node's host and nothing in
the cluster (issue 39 item 5), on a cluster of its own whose one node runs a real containerd
and runc under its real kubelet, with gpushare installed as shipped (test_daemonset_real.py's
TEST-ONLY overlay, e2e/README.md "The DaemonSet as shipped").

Two differences from test_daemonset_real.py's overlay, both TEST-ONLY and written in
e2e/README.md: the simulated node file lives in a directory of its own mounted into the
daemon (so that the host directory holds nothing but what gpushare writes, and its emptiness
can be seen), and the ``cache-fs`` init container also mounts the MPS ``/dev/shm`` tmpfs
(``--mps-shm-size-mib``, what the chart passes where MPS is on), so that a second tmpfs of
ours is on the host to be unmounted. What an MPS control daemon and a DRA driver leave
(``mps/pipe``, ``mps/log``, a claim's cache directory, its holder record, the DRA checkpoint)
cannot be made by this node (no MPS binary, no DRA in the shipped manifests): the test
writes them onto the node's host directory, inside the cache tmpfs where they live, as the
daemon would have. Everything is seen through the node's mount namespace
(``/proc/<holder>/root`` and its mountinfo), as the kubelet and containerd see it.

In file order: the install and two GPU pods that leave their cache directories; the pods
end; `uninstall --node` (nothing runs: nothing is left, the tmpfs mounts gone, the host
directory empty, no cleanup pod, no record); `kubectl delete -k`; then installed again, an
uninstall while a GPU pod runs (exactly what it holds is kept, said per node, and recorded
on the Node), and, once that pod has ended, the second `uninstall --node` that finishes the
job.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
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
from test_daemonset_real import (
    GPUS,
    NODE,
    NS,
    OPT_IN,
    UNITS,
    daemon_pods,
    keep_daemon_logs,
    ready_daemon_pod,
    run,
    write_overlay,
)

#: the simulated node file, in a directory of its own on the node (TEST ONLY)
SIM_MOUNT = "/gpushare-e2e-sim"
CLEANUP_SELECTOR = "app.kubernetes.io/name=gpushare-host-cleanup"
RECORD = f"{PREFIX}/host-cleanup"
KEY = "d" * 20
CLAIM_UID = "0b1e0c1a-0000-4000-8000-0000000000e2"


def write_uninstall_overlay(cluster: Cluster, sim_dir: Path) -> Path:
    """test_daemonset_real.py's overlay, plus the node file's own hostPath and the MPS shm
    tmpfs of the init container (module docstring)."""
    overlay = write_overlay(cluster, free_port())
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    patch = kustomization["patches"][0]
    ops = yaml.safe_load(patch["patch"])
    spec = "/spec/template/spec"
    ops += [
        {"op": "add", "path": f"{spec}/initContainers/0/args/-", "value": "--mps-shm-size-mib=64"},
        {"op": "add", "path": f"{spec}/volumes/-",
         "value": {"name": "e2e-sim", "hostPath": {"path": str(sim_dir), "type": "Directory"}}},
        {"op": "add", "path": f"{spec}/containers/0/volumeMounts/-",
         "value": {"name": "e2e-sim", "mountPath": SIM_MOUNT, "readOnly": True}},
        {"op": "add", "path": f"{spec}/containers/0/env/-",
         "value": {"name": "GPUSHARE_SIMULATE", "value": f"{SIM_MOUNT}/node.yaml"}},
    ]  # fmt: skip
    patch["patch"] = yaml.safe_dump(ops)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return overlay


@pytest.fixture(scope="module")
def node_cluster(gpushare_image: Path) -> Iterator[Cluster]:
    spec = NodeSpec(NODE, GPUS, labels={}, runtime="containerd", host_lib_dir=True)
    with running_cluster(
        [spec], logs=REPO / "e2e" / "logs" / "uninstall-cluster", install=False
    ) as c:
        agent = c.nodes[NODE]
        assert agent.containerd is not None
        agent.containerd.import_image(gpushare_image, timeout=1200)
        sim = agent.dir / "sim"
        sim.mkdir(exist_ok=True)
        (sim / "node.yaml").write_text(yaml.safe_dump({"gpus": GPUS}))
        write_uninstall_overlay(c, sim)
        try:
            yield c
        finally:
            keep_daemon_logs(c)


def install(cluster: Cluster) -> None:
    """docs/deploy.md's `kubectl apply -k` install (the TEST-ONLY overlay), then the label."""
    run(cluster, "apply", "-k", str(cluster.dir / "overlay"))
    run(cluster, "label", "node", NODE, f"{OPT_IN}=true", "--overwrite")
    ready_daemon_pod(cluster)
    cluster.wait_allocatable(NODE, lambda a: int(a.get(MEMORY, 0)) == UNITS)


def node_root(cluster: Cluster) -> Path:
    holder = cluster.nodes[NODE].holder
    assert holder is not None
    return Path(f"/proc/{holder.pid}/root")


def host_lib(cluster: Cluster) -> Path:
    """``/usr/local/vgpu`` as the node sees it (its tmpfs mounts included)."""
    return node_root(cluster) / HOST_LIB_DIR.lstrip("/")


def left(cluster: Cluster) -> set[str]:
    root = host_lib(cluster)
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def our_mounts(cluster: Cluster) -> list[str]:
    """Mounts below the host directory in the node's namespace (the directory itself is
    the e2e's shared bind mount, NodeSpec.host_lib_dir)."""
    holder = cluster.nodes[NODE].holder
    assert holder is not None
    lines = Path(f"/proc/{holder.pid}/mountinfo").read_text().splitlines()
    return [line.split()[4] for line in lines if line.split()[4].startswith(f"{HOST_LIB_DIR}/")]


def plant_mps_and_dra_leftovers(cluster: Cluster) -> None:
    """What an MPS control daemon and a DRA driver leave in the host directory (module
    docstring), written where they would: the cache tmpfs holds the claim's directory."""
    root = host_lib(cluster)
    for sub in ("mps/pipe/ns-1", "mps/log", f"claimholders/d-{KEY}", "dra", f"containers/d-{KEY}"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "mps" / "pipe" / "control").write_text("")
    (root / "mps" / "log" / "control.log").write_text("started\n")
    (root / "mps" / "shm" / "cuda.shm.0").write_bytes(b"\0" * 4096)
    (root / "claimholders" / f"d-{KEY}" / "holder").write_text("/k8s.io/gone\n")
    (root / "dra" / f"{CLAIM_UID}.json").write_text("{}")
    (root / "containers" / f"d-{KEY}" / "cache").write_bytes(b"x" * 64)


def uninstall(cluster: Cluster) -> str:
    started = time.monotonic()
    done = cluster.kubectl_gpushare("uninstall", "--node", NODE, "--wait", "120")
    out = done.stdout + done.stderr
    print(f"uninstall took {time.monotonic() - started:.0f} s:\n{out}")
    assert done.returncode == 0, out
    return out


def cleanup_pods(cluster: Cluster) -> list[dict[str, Any]]:
    pods = cluster.api.get("/api/v1/pods", labelSelector=CLEANUP_SELECTOR)["items"]
    return list(pods)


def assert_nothing_in_the_cluster(cluster: Cluster) -> None:
    run(cluster, "delete", "-k", str(cluster.dir / "overlay"), "--wait=true")
    assert cleanup_pods(cluster) == []
    assert daemon_pods(cluster) == []
    node = cluster.node(NODE)
    assert not [k for k in node["metadata"].get("labels", {}) if k.startswith(PREFIX)], node
    assert not [k for k in node["metadata"].get("annotations", {}) if k.startswith(PREFIX)]
    for path in (
        f"/apis/apps/v1/namespaces/{NS}/daemonsets/gpushare",
        f"/api/v1/namespaces/{NS}/serviceaccounts/gpushare",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles/gpushare",
        f"/api/v1/namespaces/{NS}/configmaps/gpushare-node-{NODE}",
    ):
        assert cluster.api.get_or_none(path) is None, path


def assert_nothing_on_the_host(cluster: Cluster) -> None:
    assert left(cluster) == set(), sorted(left(cluster))
    assert our_mounts(cluster) == []
    agent = cluster.nodes[NODE]
    sockets = sorted(p.name for p in (agent.root / "device-plugins").glob("*.sock"))
    assert sockets == ["kubelet.sock"], sockets


def test_gpu_pods_leave_their_caches_in_the_tmpfs(node_cluster: Cluster) -> None:
    install(node_cluster)
    for name in ("leaves-a", "leaves-b"):
        node_cluster.create_pod(pod_manifest(name, {MEMORY: 4, CORE: 30}, node=NODE, report=True))
    for name in ("leaves-a", "leaves-b"):
        node_cluster.wait_pod("default", name, "Running")
    plant_mps_and_dra_leftovers(node_cluster)
    caches = {p for p in left(node_cluster) if p.startswith("containers/c-") and "." not in p}
    assert len(caches) == 2, sorted(left(node_cluster))
    assert {f"{HOST_LIB_DIR}/containers", f"{HOST_LIB_DIR}/mps/shm"} <= set(
        our_mounts(node_cluster)
    )
    for name in ("leaves-a", "leaves-b"):
        node_cluster.delete_pod("default", name)


def test_uninstall_where_no_gpu_container_runs_leaves_nothing_on_the_host(
    node_cluster: Cluster,
) -> None:
    assert {"mps", "claimholders", "dra", "containers"} <= left(node_cluster)
    out = uninstall(node_cluster)
    assert f"nothing of gpushare is left on {NODE}'s host" in out, out
    assert "unmounted containers, mps/shm" in out, out
    # the host directory is the e2e's bind mount: emptied, and said to stay as a mount point
    assert f"{HOST_LIB_DIR}: empty, left: a mount point" in out, out
    assert_nothing_on_the_host(node_cluster)
    assert_nothing_in_the_cluster(node_cluster)


def test_uninstall_while_a_gpu_pod_runs_keeps_what_it_holds_and_a_second_run_finishes(
    node_cluster: Cluster,
) -> None:
    install(node_cluster)
    node_cluster.create_pod(pod_manifest("stays", {MEMORY: 4, CORE: 30}, node=NODE, report=True))
    try:
        node_cluster.wait_pod("default", "stays", "Running")
        out = uninstall(node_cluster)
        assert f"{NODE} keeps what running GPU containers hold" in out, out
        assert "its container is running" in out, out
        kept = left(node_cluster)
        caches = sorted(p for p in kept if p.startswith("containers/c-") and "." not in p)
        assert len(caches) == 1, sorted(kept)
        libraries = [p for p in kept if p.startswith("libvgpu.so.")]
        assert len(libraries) == 1, sorted(kept)
        version = libraries[0].rsplit(".", 1)[1]
        maybe = {f"ld.so.preload.{version}"} | {
            p for p in kept if p.startswith("gpushare-memory-hook.")
        }
        # MPS's directory and its shm tmpfs stay while containers hold memory units (an MPS
        # client among them would map segments there)
        assert kept - maybe == {
            "mps",
            "mps/shm",
            "containers",
            "containers/vgpulock",
            caches[0],
            f"{caches[0]}.json",
            "memory-unit.json",
            libraries[0],
        }, sorted(kept)
        assert sorted(our_mounts(node_cluster)) == [
            f"{HOST_LIB_DIR}/containers",
            f"{HOST_LIB_DIR}/mps/shm",
        ]
        assert cleanup_pods(node_cluster) == []
        assert RECORD in (node_cluster.node(NODE)["metadata"].get("annotations") or {})
    finally:
        node_cluster.delete_pod("default", "stays")
    out = uninstall(node_cluster)
    assert f"nothing of gpushare is left on {NODE}'s host" in out, out
    assert_nothing_on_the_host(node_cluster)
    assert_nothing_in_the_cluster(node_cluster)
    wait_for("no cleanup pod", lambda: not cleanup_pods(node_cluster) or None, 30)
