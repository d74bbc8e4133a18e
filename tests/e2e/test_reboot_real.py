"""A node "reboot" on the real runtime (containerd + runc, tests/e2e/real_runtime.py): the
kubelet, containerd and the daemon stopped, every container of the node gone, the node's
CDI directory and the daemon's cache root emptied like fresh tmpfs, everything started
again. The pods bound to the node stay bound; the kubelet starts their containers again
with the devices it kept in its checkpoints, prepares their DRA claims again, and each
container's limits are read from inside it (its ``/report``), before and after.

The node (``node-5``, a name test_dra.py also gives one of its nodes for a while): two
Tesla P4, device-list strategy ``cdi-cri`` (every device-plugin grant rides on the
daemon's own CDI spec), card 1 under DRA.

The daemon starts before the kubelet here, with the configuration its DaemonSet pod got
before the reboot: a kubelet v1.36 admits every pod again at its start and rejects a pod
whose device-plugin resource has no healthy device yet ("no healthy devices present":
its checkpoint restores the resource empty until the plugin registers again;
``devicesToAllocate``'s node-reboot case): Kubernetes' behaviour for every device
plugin, which a daemon run as a DaemonSet pod (started by that same kubelet) cannot win.
Seen here with the daemon started after the kubelet (2026-12-07, v1.36.3): the shared pod
ended Failed, "Pod was rejected: Allocate failed due to no healthy devices present; cannot
allocate unhealthy devices gpushare.io/vcuda-core, which is unexpected"; the DRA pod came
back with its limits.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_nodes import CARD_SPEC, TESLA_P4, cards, write_card_spec
from kube_cluster import (
    CORE,
    MEMORY,
    REPO,
    Cluster,
    NodeAgent,
    NodeSpec,
    load_manifests,
    pod_manifest,
    wait_for,
)
from local_image import environ

#: a spare node name of the session (its credentials exist); modules add and remove theirs
NODE = "node-5"
RESOURCE = "/apis/resource.k8s.io/v1"
P4S = cards(13, TESLA_P4, 2)
SHARED_CARD, DRA_CARD = P4S[0]["uuid"], P4S[1]["uuid"]
UNIT_MIB = 256
NVIDIA_SPEC = CARD_SPEC  # as in /etc/cdi: not on a tmpfs, kept


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> Iterator[NodeAgent]:
    cluster.api.apply_all(load_manifests(REPO / "daemonset" / "dra" / "rbac.yaml"))
    cluster.api.apply_all(load_manifests(REPO / "daemonset" / "dra" / "deviceclasses.yaml"))
    cdi = cluster.dir / NODE / "cdi"
    cdi.mkdir(parents=True, exist_ok=True)
    write_card_spec(cdi, P4S)
    spec = NodeSpec(
        NODE,
        P4S,
        daemon_args=[
            "--device-list-strategy=cdi-cri",
            f"--dra-cdi-dir={cdi}",
            f"--cdi-spec-dirs={cdi}",
            "--card-modes=1=dra",
            "--dra-resync-seconds=1",
            "--pod-resources-interval-seconds=2",
        ],
        runtime="containerd",
    )
    agent = cluster.add_node(spec)
    try:
        yield agent
    finally:
        cluster.remove_node(NODE)
        cluster.api.delete(f"{RESOURCE}/resourceslices", fieldSelector=f"spec.nodeName={NODE}")


def claim_template(name: str) -> dict[str, Any]:
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": "gpushare.io",
            "capacity": {"requests": {"memory": "2Gi", "cores": "40"}},
        },
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [request]}}},
    }


def limits(env: dict[str, str]) -> tuple[str, str, str, str]:
    return (
        env.get("SIM_CARD", ""),
        env.get("CUDA_DEVICE_MEMORY_LIMIT_0", ""),
        env.get("CUDA_DEVICE_SM_LIMIT", ""),
        env.get("LD_PRELOAD", ""),
    )


def container_id(cluster: Cluster, pod: str) -> str:
    statuses = (cluster.pod("default", pod) or {}).get("status", {}).get("containerStatuses", [])
    return str(statuses[0].get("containerID", "")) if statuses else ""


def reboot(cluster: Cluster, agent: NodeAgent) -> None:
    """Everything of the node stopped and its containers gone; the tmpfs emptied; the
    runtime, the daemon (with its pod's configuration from before) and the kubelet started
    again, in that order."""
    config = agent._daemon_container_config()  # read through the kubelet, while it runs
    agent.stop_daemon()
    agent.stop_kubelet()
    assert agent.cri is not None and agent.containerd is not None
    agent.cri.stop(grace=10)
    agent.cri = None
    agent.containerd.clean_up()
    for path in agent.cdi_dir.iterdir():
        if path.name != NVIDIA_SPEC:
            path.unlink()
    root = agent.vgpu / "containers"
    for path in root.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    agent._start_containerd()
    agent._daemon_container_config = lambda: config  # type: ignore[method-assign]
    try:
        agent.start_daemon(wait=False)
    finally:
        del agent._daemon_container_config
    agent.start_kubelet()
    cluster.wait_node_ready(agent.name)


def test_a_dra_pod_and_a_cdi_pod_come_back_with_their_limits(
    cluster: Cluster, node: NodeAgent
) -> None:
    made: list[str] = []
    try:
        reply = cluster.api.create(claim_template("rb-claim"))
        assert reply.status_code == 201, reply.text[:400]
        claim_pod = pod_manifest("rb-claim", node=NODE, report=True)
        claim_pod["spec"]["resourceClaims"] = [
            {"name": "gpu", "resourceClaimTemplateName": "rb-claim"}
        ]
        claim_pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        for pod in (
            pod_manifest("rb-share", {MEMORY: 4, CORE: 30}, node=NODE, report=True),
            claim_pod,
        ):
            cluster.create_pod(pod)
            made.append(pod["metadata"]["name"])
        before = {}
        for pod in made:
            cluster.wait_pod("default", pod, "Running")
            before[pod] = (
                container_id(cluster, pod),
                environ(cluster.wait_report("default", pod, "main")),
            )
        assert limits(before["rb-share"][1]) == (
            SHARED_CARD,
            f"{4 * UNIT_MIB}m",
            "30",
            "/usr/local/vgpu/libvgpu.so",
        )
        assert limits(before["rb-claim"][1]) == (
            DRA_CARD,
            "2048m",
            "40",
            "/usr/local/vgpu/libvgpu.so",
        )
        specs = sorted(p.name for p in node.cdi_dir.iterdir() if p.name != NVIDIA_SPEC)
        assert len(specs) == 3, specs  # two grants and one claim

        reboot(cluster, node)

        for pod in made:
            # the same pod, a new container, started from the kubelet's kept answers

            def started(pod: str = pod) -> bool:
                status = (cluster.pod("default", pod) or {}).get("status", {})
                return status.get("phase") == "Running" and container_id(cluster, pod) not in (
                    "",
                    before[pod][0],
                )

            wait_for(f"{pod} running a new container", started, 240, step=1)
            after = environ(cluster.wait_report("default", pod, "main", timeout=120))
            assert limits(after) == limits(before[pod][1]), after
        assert sorted(p.name for p in node.cdi_dir.iterdir() if p.name != NVIDIA_SPEC) == specs
        log = (node.dir / "daemon.log").read_text(errors="replace")
        assert "claim_rebuilt" in log and "grant_rebuilt" in log
    finally:
        for pod in made:
            if cluster.pod("default", pod) is not None:
                cluster.delete_pod("default", pod)
        cluster.api.delete(
            "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates/rb-claim"
        )
