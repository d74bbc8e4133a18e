"""Scenario 1: the daemon registers with the real kubelet; it survives kill -9 of itself and a
kubelet restart (both seen through the Node object and pods the real kubelet admits)."""

from __future__ import annotations

import re
from pathlib import Path

from e2e_nodes import NODES
from kube_cluster import CORE, MEMORY, Cluster, pod_manifest


def expected_units(node: str) -> tuple[int, int]:
    """(vcuda-memory, vcuda-core) the node's simulated cards make: 256 MiB and 1 % units."""
    spec = next(n for n in NODES if n.name == node)
    return sum(g["memory_mib"] // 256 for g in spec.gpus), 100 * len(spec.gpus)


def test_the_daemon_registers_both_resources_with_the_kubelet(cluster: Cluster) -> None:
    for node in ("node-1", "node-2"):
        memory, core = expected_units(node)
        # the Node's status is the kubelet's, written every 2 s: an earlier test's kubelet
        # restart or daemon restart may still show (each resource registers on its own)
        alloc = cluster.wait_allocatable(
            node,
            lambda a, m=memory, c=core: int(a.get(MEMORY, "0")) == m and int(a.get(CORE, "0")) == c,
        )
        assert int(alloc[MEMORY]) == memory, alloc
        assert int(alloc[CORE]) == core, alloc
        capacity = cluster.node(node)["status"]["capacity"]
        assert int(capacity[MEMORY]) == memory


def test_a_pod_is_admitted_and_gets_the_daemons_answer(cluster: Cluster) -> None:
    cluster.create_pod(pod_manifest("reg-first", {MEMORY: 4, CORE: 10}, node="node-1"))
    try:
        cluster.wait_pod("default", "reg-first", "Running")
        env = cluster.wait_record("node-1", "default", "reg-first", "main")["env"]
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m"
        assert env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
    finally:
        cluster.delete_pod("default", "reg-first")


def test_kill_9_of_the_daemon_and_its_restart(cluster: Cluster) -> None:
    agent = cluster.nodes["node-2"]
    memory, _ = expected_units("node-2")
    agent.kill_daemon()
    # The kubelet sees the plugin's stream end and stops offering its devices.
    cluster.wait_allocatable("node-2", lambda a: int(a.get(MEMORY, "0")) == 0)
    cluster.create_pod(pod_manifest("reg-while-down", {MEMORY: 2}, node="node-2"))
    try:
        cluster.wait_scheduling_refused("default", "reg-while-down")
        agent.start_daemon()
        cluster.wait_allocatable("node-2", lambda a: int(a.get(MEMORY, "0")) == memory)
        # The pod that waited is placed once the units are back, and admitted.
        cluster.wait_pod("default", "reg-while-down", "Running")
        env = cluster.wait_record("node-2", "default", "reg-while-down", "main")["env"]
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "512m"
    finally:
        cluster.delete_pod("default", "reg-while-down")


def test_the_daemon_registers_again_after_a_kubelet_restart(cluster: Cluster) -> None:
    agent = cluster.nodes["node-1"]
    memory, core = expected_units("node-1")
    cluster.create_pod(pod_manifest("reg-before", {MEMORY: 4, CORE: 10}, node="node-1"))
    try:
        cluster.wait_pod("default", "reg-before", "Running")
        daemon = agent.daemon
        agent.restart_kubelet()
        assert daemon is not None and daemon.alive(), "the daemon died with the kubelet"
        # A pod admitted after the restart needs Allocate through the NEW kubelet's
        # registration of the daemon: Running proves it re-registered.
        cluster.create_pod(pod_manifest("reg-after", {MEMORY: 8, CORE: 20}, node="node-1"))
        try:
            cluster.wait_pod("default", "reg-after", "Running")
            env = cluster.wait_record("node-1", "default", "reg-after", "main")["env"]
            assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m"
            # Both resources come back in the Node's status; each is registered on its own,
            # and the kubelet's status may be written between the two registrations.
            alloc = cluster.wait_allocatable(
                "node-1",
                lambda a: int(a.get(MEMORY, "0")) == memory and int(a.get(CORE, "0")) == core,
            )
            assert (int(alloc[MEMORY]), int(alloc[CORE])) == (memory, core)
            # The pod from before the restart is still running.
            pod = cluster.pod("default", "reg-before")
            assert pod is not None and pod["status"]["phase"] == "Running"
        finally:
            cluster.delete_pod("default", "reg-after")
    finally:
        cluster.delete_pod("default", "reg-before")


def run_on(cluster: Cluster, node: str, script: str) -> str:
    """The output of ``script`` run on ``node`` (in its mount namespace)."""
    log = cluster.nodes[node].dir / "e2e-sh.log"
    start = log.stat().st_size if log.exists() else 0
    proc = cluster.nodes[node].spawn("e2e-sh", ["sh", "-c", script])
    assert proc.popen.wait(30) == 0, proc.tail()
    proc.stop()
    with log.open() as f:
        f.seek(start)
        return f.read().split("\n", 2)[-1]  # after the harness's "=== <command>" line


def test_a_program_spawned_on_a_node_sees_that_nodes_kubelet_directory(cluster: Cluster) -> None:
    """What a DRA driver or another plugin started with NodeAgent.spawn would see: the
    kubelet's fixed paths, each node's own."""
    for node in ("node-1", "node-2"):
        listing = run_on(cluster, node, "ls /var/lib/kubelet/device-plugins")
        # the instance's first name (its token), or a fresh one where the daemon offered
        # the same kubelet its path again (docs/restarts.md: one path to one kubelet once)
        assert re.search(r"^gpushare-vcuda-memory\.[0-9a-f]{6}(-[0-9]+)?\.sock$", listing, re.M)
        assert "kubelet.sock" in listing
    marker = cluster.nodes["node-1"].root / "e2e-marker"
    try:
        run_on(cluster, "node-1", "touch /var/lib/kubelet/e2e-marker")
        assert marker.exists()  # node-1's /var/lib/kubelet is its own directory
        assert "e2e-marker" not in run_on(cluster, "node-2", "ls /var/lib/kubelet")
        assert not Path("/var/lib/kubelet/e2e-marker").exists()  # nor the host's
    finally:
        marker.unlink(missing_ok=True)


def test_units_held_before_a_kubelet_restart_count_after_it(cluster: Cluster) -> None:
    """node-2's cards hold 16 units each. A pod holding 12 on one card before the kubelet
    restarts leaves 4 there: a second pod of 12 after the restart must get the other card,
    memory and cores alike (the kubelet's checkpoint and the daemon's view agree)."""
    limits = {MEMORY: 12, CORE: 50}
    cluster.create_pod(pod_manifest("held-before", limits, node="node-2"))
    try:
        cluster.wait_pod("default", "held-before", "Running")
        first = cluster.wait_record("node-2", "default", "held-before", "main")["env"]
        cluster.nodes["node-2"].restart_kubelet()
        cluster.create_pod(pod_manifest("held-after", limits, node="node-2"))
        try:
            cluster.wait_pod("default", "held-after", "Running")
            second = cluster.wait_record("node-2", "default", "held-after", "main")["env"]
            assert second["NVIDIA_VISIBLE_DEVICES"] != first["NVIDIA_VISIBLE_DEVICES"]
            cards: dict[str, set[str]] = {}
            for entry in cluster.nodes["node-2"].pod_resources():
                if entry["name"] == "held-after":
                    for c in entry["containers"]:
                        for dev in c.get("devices", []):
                            cards.setdefault(dev["resource_name"], set()).update(
                                i.rpartition("::")[0] for i in dev["device_ids"]
                            )
            assert cards == {
                MEMORY: {second["NVIDIA_VISIBLE_DEVICES"]},
                CORE: {second["NVIDIA_VISIBLE_DEVICES"]},
            }
        finally:
            cluster.delete_pod("default", "held-after")
    finally:
        cluster.delete_pod("default", "held-before")
