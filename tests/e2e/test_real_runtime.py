"""Limits read from inside real containers (issue 39 items 2 and 4): two nodes whose kubelets
talk to a real containerd (CRI, CDI on) running real runc (tests/e2e/real_runtime.py), added
to the session cluster for this module.

Every GPU container here runs the e2e image's ``/report`` (tests/e2e/local_image.py), which
prints what its first process really has: its environ, its mounts (/proc/1/mountinfo),
/etc/ld.so.preload, the entries of CUDA_MPS_PIPE_DIRECTORY, its cgroup. Each scenario is
judged from that report, read from the container's log through the API server (what
`kubectl logs` reads), never from the CRI request:

* ``node-7`` (device-list strategy ``envvar``, the default): three Tesla P4, card 0 shared,
  card 1 time-sliced (2 replicas), card 2 whole only (``--whole-cards``), and an A100 cut
  into MIG instances (``--mig-strategy mixed``): shared units, a whole card, a MIG
  instance, a time-sliced replica;
* ``node-8`` (``cdi-cri``, the driver's memory limits, MPS compute shares, one card under
  DRA), the setting of test_driver_and_mps.py's node-6 on the real runtime: the ``driver``
  backend's hook, named in the daemon's CDI spec, is run by runc itself (createRuntime)
  against the container's real cgroup with the stand-in NVML; MPS pipes; a DRA claim; and a
  pod that sets every reserved name in its own env, in envFrom, in an init container and
  in a sidecar, with the admission policy on (refused) and off (what the runtime made of
  it).

**cgroups.** This machine's controllers are on cgroup v1; its cgroup v2 hierarchy is mounted
at /sys/fs/cgroup/unified, without controllers. runc (hybrid mode) puts every container in
both: ``0::/k8s.io/<id>`` in the v2 one. node-8's daemon is told ``--cgroup-root
/sys/fs/cgroup/unified``, so its hook sets the limit on that real leaf (the stand-in NVML
keeps it by path). runc in unified mode (cgroup v2 at /sys/fs/cgroup) cannot run here: the
kubelet always sets cpu shares, and with no controller in the v2 hierarchy runc 1.5.3 stops
with "openat2 /sys/fs/cgroup/<id>/cpu.weight: no such file or directory" (BRIEF).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_nodes import TESLA_P4, cards, write_card_spec
from kube_cluster import (
    CORE,
    MEMORY,
    PREFIX,
    REPO,
    WHOLE,
    Cluster,
    NodeSpec,
    load_manifests,
    pod_manifest,
)
from local_image import env_entries, environ, mounts
from test_driver_and_mps import build_standins, driver_limits, new_limits
from test_pod_env import WIDEN_ENV, policy_off
from test_whole_and_mig import MIG_1G, MIG_CARD, mig_uuid

NODE = "node-7"
CDI_NODE = "node-8"
SHARED_GPU = f"{PREFIX}/gpu.shared"
RESOURCE = "/apis/resource.k8s.io/v1"
DRIVER = "gpu.gpushare.io"
UNIT_MIB = 256
#: the v2 hierarchy runc puts each container in beside the v1 ones (hybrid mode)
UNIFIED = "/sys/fs/cgroup/unified"
P4S7 = cards(7, TESLA_P4, 3)
MIG7 = {**MIG_CARD, "index": 3}
P4S8 = [{**g, "memory_limits": "ok"} for g in cards(8, TESLA_P4, 2)]
MPS_CARD, DRA_CARD = P4S8[0]["uuid"], P4S8[1]["uuid"]
CONTAINER_MPS_PIPE = "/tmp/nvidia-mps"
LIBRARY = "/usr/local/vgpu/libvgpu.so"


@pytest.fixture(scope="module")
def node7(cluster: Cluster) -> Iterator[str]:
    spec = NodeSpec(
        NODE,
        [*P4S7, MIG7],
        daemon_args=[
            "--whole-cards",
            "--mig-strategy=mixed",
            "--card-modes=1=timeslice,2=exclusive",
            "--time-slice-replicas=2",
            "--preload=both",  # LD_PRELOAD and a mounted /etc/ld.so.preload
        ],
        runtime="containerd",
    )
    cluster.add_node(spec)
    yield NODE
    cluster.remove_node(NODE)


@pytest.fixture(scope="module")
def node8(cluster: Cluster) -> Iterator[Path]:
    """node-8: the driver backend, MPS on card 0, card 1 under DRA, CDI for every grant."""
    hook, nvml, mps = build_standins(cluster.dir / "node-8-standins")
    cluster.api.apply_all(load_manifests(REPO / "daemonset" / "dra" / "rbac.yaml"))
    cluster.api.apply_all(load_manifests(REPO / "daemonset" / "dra" / "deviceclasses.yaml"))
    cdi = cluster.dir / CDI_NODE / "cdi"
    cdi.mkdir(parents=True, exist_ok=True)
    write_card_spec(cdi, P4S8)
    spec = NodeSpec(
        CDI_NODE,
        P4S8,
        daemon_args=[
            "--device-list-strategy=cdi-cri",
            f"--dra-cdi-dir={cdi}",
            f"--cdi-spec-dirs={cdi}",
            "--card-modes=1=dra",
            "--dra-resync-seconds=1",
            "--memory-enforcement=driver",
            "--compute-enforcement=interposer,0=mps",
            f"--memory-hook={hook}",
            f"--mps-control={mps}",
            f"--cgroup-root={UNIFIED}",
        ],
        node_file={"driver_version": "615.20.01", "nvml_library": str(nvml)},
        runtime="containerd",
    )
    cluster.add_node(spec)
    try:
        yield cluster.dir / CDI_NODE
    finally:
        cluster.remove_node(CDI_NODE)
        cluster.api.delete(f"{RESOURCE}/resourceslices", fieldSelector=f"spec.nodeName={CDI_NODE}")
        for obj in load_manifests(REPO / "daemonset" / "dra" / "deviceclasses.yaml"):
            cluster.api.delete(cluster.api.path(obj))


class Pods:
    """Pods (and claim templates, ConfigMaps) a test created, deleted at its end."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.names: list[str] = []
        self.deletes: list[str] = []

    def create(self, pod: dict[str, Any]) -> dict[str, Any]:
        self.names.append(pod["metadata"]["name"])
        return self.cluster.create_pod(pod)

    def report(self, name: str, node: str, containers: dict[str, dict[str, int]]) -> dict[str, Any]:
        return self.create(pod_manifest(name, containers=containers, node=node, report=True))

    def object(self, obj: dict[str, Any]) -> None:
        reply = self.cluster.api.create(obj)
        assert reply.status_code == 201, reply.text[:400]
        self.deletes.append(self.cluster.api.path(obj))

    def cleanup(self) -> None:
        for name in self.names:
            if self.cluster.pod("default", name) is not None:
                self.cluster.delete_pod("default", name)
        for path in self.deletes:
            self.cluster.api.delete(path)


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[Pods]:
    made = Pods(cluster)
    yield made
    made.cleanup()


def inside(cluster: Cluster, pod: str, container: str = "main") -> dict[str, list[str]]:
    cluster.wait_pod("default", pod, "Running")
    return cluster.wait_report("default", pod, container)


def v2_cgroup(report: dict[str, list[str]]) -> str:
    """The container's cgroup v2 path (its ``0::`` line), checked to be a leaf of its own."""
    (line,) = [c for c in report["cgroup"] if c.startswith("0::")]
    path = line[3:]
    assert path.startswith("/k8s.io/") and len(path) > len("/k8s.io/"), report["cgroup"]
    return path


# --------------------------------------------------------------------------- node-7: envvar


def test_shared_units_inside_the_container(cluster: Cluster, node7: str, pods: Pods) -> None:
    pods.report("rt-shared", node7, {"main": {MEMORY: 4, CORE: 30}})
    report = inside(cluster, "rt-shared")
    env = environ(report)
    assert env["NVIDIA_VISIBLE_DEVICES"] == P4S7[0]["uuid"], env
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{4 * UNIT_MIB}m", env
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30", env
    assert env["LD_PRELOAD"] == LIBRARY, env
    assert report["ld.so.preload"] == [LIBRARY], report["ld.so.preload"]
    seen = mounts(report)
    assert LIBRARY in seen and "/etc/ld.so.preload" in seen, sorted(seen)
    v2_cgroup(report)


def test_a_whole_card_a_mig_instance_and_a_replica_inside(
    cluster: Cluster, node7: str, pods: Pods
) -> None:
    pods.report("rt-whole", node7, {"main": {WHOLE: 1}})
    pods.report("rt-mig", node7, {"main": {MIG_1G: 1}})
    pods.report("rt-slice", node7, {"main": {SHARED_GPU: 1}})
    whole, mig, replica = (environ(inside(cluster, p)) for p in ("rt-whole", "rt-mig", "rt-slice"))
    # card 2 is whole only, card 0 both (no shared units held now); never the replica card
    assert whole["NVIDIA_VISIBLE_DEVICES"] in (P4S7[0]["uuid"], P4S7[2]["uuid"]), whole
    assert mig["NVIDIA_VISIBLE_DEVICES"] in (mig_uuid(2), mig_uuid(3)), mig
    assert replica["NVIDIA_VISIBLE_DEVICES"] == P4S7[1]["uuid"], replica
    for env in (whole, mig, replica):  # no interposer where the card is not shared
        assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in env and "LD_PRELOAD" not in env, env
    assert inside(cluster, "rt-whole")["ld.so.preload"] == ["(absent)"]


def test_envvar_policy_off_a_whole_cards_pod_widens_its_devices(
    cluster: Cluster, node7: str, pods: Pods
) -> None:
    """The policy off, strategy ``envvar``: the pod's own ``NVIDIA_VISIBLE_DEVICES=all`` is
    the only value the process has (the kubelet merges the device plugin's env and the
    pod's by name, the pod's winning, and sends one entry), as docs/security.md says: under
    ``envvar`` keep the policy on or choose a CDI strategy."""
    pod = pod_manifest("rt-widen", {WHOLE: 1}, node=NODE, report=True)
    pod["spec"]["containers"][0]["env"] = WIDEN_ENV
    with policy_off(cluster):
        pods.create(pod)
        report = inside(cluster, "rt-widen")
    assert env_entries(report, "NVIDIA_VISIBLE_DEVICES") == ["all"], report["environ"]


# --------------------------------------------------------------------------- node-8: cdi-cri


def test_the_driver_hook_run_by_runc_limits_the_containers_own_cgroup(
    cluster: Cluster, node8: Path, pods: Pods
) -> None:
    before = driver_limits(node8)
    pods.report("rt-drv", CDI_NODE, {"big": {MEMORY: 8, CORE: 30}, "small": {MEMORY: 4, CORE: 20}})
    expected = {}
    for container, mib in (("big", 8 * UNIT_MIB), ("small", 4 * UNIT_MIB)):
        report = inside(cluster, "rt-drv", container)
        env = environ(report)
        assert (env["NVIDIA_VISIBLE_DEVICES"], env["SIM_CARD"]) == ("void", MPS_CARD), env
        assert not any(k.startswith("CUDA_DEVICE_MEMORY_LIMIT") for k in env), env
        expected[(MPS_CARD, UNIFIED + v2_cgroup(report))] = (0, mib << 20)
    # one limit per container, on the leaf runc made for it, equal to its grant
    assert new_limits(node8, before) == expected


def test_each_container_on_the_mps_card_sees_its_own_pipes(
    cluster: Cluster, node8: Path, pods: Pods
) -> None:
    shares = {"a": 30, "b": 55}
    pods.report("rt-mps", CDI_NODE, {n: {MEMORY: 2, CORE: c} for n, c in shares.items()})
    state_file = node8 / "vgpu" / "mps" / "pipe" / "standin-state.json"
    pipes = set()
    for name, cores in shares.items():
        report = inside(cluster, "rt-mps", name)
        env = environ(report)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == CONTAINER_MPS_PIPE, env
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(cores), env
        assert "LD_PRELOAD" not in env, env
        assert report["mps"][0] == f"dir={CONTAINER_MPS_PIPE}", report["mps"]
        (line,) = [m for m in report["mountinfo"] if m.split()[4] == CONTAINER_MPS_PIPE]
        assert " ro," in f" {line.split()[5]}," or line.split()[5].startswith("ro"), line
        state = json.loads(state_file.read_text())
        (namespace,) = [
            n for n in state["namespaces"].values() if n["pipe"].endswith(line.split()[3])
        ]
        assert namespace["percent"] == cores, namespace
        pipes.add(namespace["pipe"])
    assert len(pipes) == 2


def test_a_dra_claim_inside_the_container(cluster: Cluster, node8: Path, pods: Pods) -> None:
    before = driver_limits(node8)
    cel = f'device.attributes["{DRIVER}"].memoryEnforcement == "driver"'
    pods.object(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "rt-claim", "namespace": "default"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "exactly": {
                                    "deviceClassName": "gpushare.io",
                                    "capacity": {"requests": {"memory": "2Gi", "cores": "40"}},
                                    "selectors": [{"cel": {"expression": cel}}],
                                },
                            }
                        ]
                    }
                }
            },
        }
    )
    pod = pod_manifest("rt-claim", node=CDI_NODE, report=True)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "rt-claim"}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    pods.create(pod)
    report = inside(cluster, "rt-claim")
    env = environ(report)
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["SIM_CARD"]) == ("void", DRA_CARD), env
    assert new_limits(node8, before) == {(DRA_CARD, UNIFIED + v2_cgroup(report)): (0, 2048 << 20)}


# --------------------------------------------------------------------------- reserved names

#: every name gpushare reserves (the policy's list), each set to what a tenant would want
HOSTILE = {
    "ACTIVE_OOM_KILLER": "false",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/tenant-cache",
    "CUDA_DISABLE_CONTROL": "true",
    "CUDA_REDIRECT": "/tmp/tenant.so",
    "CUDA_TASK_PRIORITY": "0",
    "GPU_CORE_UTILIZATION_POLICY": "disable",
    "LD_PRELOAD": "",
    "NVIDIA_VISIBLE_DEVICES": "all",
    "CUDA_DEVICE_MEMORY_LIMIT": "99999m",
    "CUDA_DEVICE_MEMORY_LIMIT_0": "99999m",
    "CUDA_DEVICE_SM_LIMIT": "100",
    "CUDA_DEVICE_SM_LIMIT_0": "100",
    "CUDA_MPS_PIPE_DIRECTORY": "/tmp/tenant-mps",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
    "NVIDIA_GPU_MEMORY_LIMIT": "99999",
}
HOSTILE_ENV = [{"name": k, "value": v} for k, v in HOSTILE.items()]


def _report_container(name: str, limits: dict[str, int] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": name,
        "image": pod_manifest("x", report=True)["spec"]["containers"][0]["image"],
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "/report"],
    }
    if limits:
        c["resources"] = {"limits": {k: str(v) for k, v in limits.items()}}
    return c


def _hostile_pods(configmap: str) -> dict[str, dict[str, Any]]:
    """One pod per place a tenant can set the reserved names, each asking shared units in
    the container that sets them."""
    grant = {MEMORY: 4, CORE: 30}
    shapes: dict[str, dict[str, Any]] = {}
    env = pod_manifest("rt-env", {**grant}, node=CDI_NODE, report=True)
    env["spec"]["containers"][0]["env"] = HOSTILE_ENV
    shapes["env"] = env
    env_from = pod_manifest("rt-envfrom", {**grant}, node=CDI_NODE, report=True)
    env_from["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": configmap}}]
    shapes["envFrom"] = env_from
    init = pod_manifest("rt-init", {MEMORY: 2}, node=CDI_NODE, report=True)
    init["spec"]["initContainers"] = [
        {**_report_container("init", grant), "command": ["/bin/sh", "/report", "once"],
         "env": HOSTILE_ENV}
    ]  # fmt: skip
    shapes["init container"] = init
    sidecar = pod_manifest("rt-sidecar", {MEMORY: 2}, node=CDI_NODE, report=True)
    sidecar["spec"]["initContainers"] = [
        {**_report_container("sidecar", grant), "restartPolicy": "Always", "env": HOSTILE_ENV}
    ]
    shapes["sidecar"] = sidecar
    return shapes


def test_reserved_names_in_env_envfrom_init_and_sidecar_are_refused_at_admission(
    cluster: Cluster, node8: Path, pods: Pods
) -> None:
    pods.object(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "rt-hostile", "namespace": "default"},
            "data": HOSTILE,
        }
    )
    for place, pod in _hostile_pods("rt-hostile").items():
        reply = cluster.api.create(pod)
        assert reply.status_code == 403, (place, reply.status_code, reply.text[:300])
        assert "gpushare" in reply.text and "reserved-settings" in reply.text, (place, reply.text)


def test_reserved_names_where_no_grant_is_reach_no_gpu_container(
    cluster: Cluster, node8: Path, pods: Pods
) -> None:
    """An init container and a sidecar WITHOUT gpushare resources may set every reserved
    name (admitted): they hold no card, and what they set stays in their own process; the
    GPU container beside them runs with its grant's values."""
    pod = pod_manifest("rt-beside", {MEMORY: 4, CORE: 30}, node=CDI_NODE, report=True)
    pod["spec"]["initContainers"] = [
        {**_report_container("init"), "command": ["/bin/sh", "/report", "once"],
         "env": HOSTILE_ENV},
        {**_report_container("sidecar"), "restartPolicy": "Always", "env": HOSTILE_ENV},
    ]  # fmt: skip
    pods.create(pod)
    main = environ(inside(cluster, "rt-beside"))
    assert (main["NVIDIA_VISIBLE_DEVICES"], main["SIM_CARD"]) == ("void", MPS_CARD), main
    assert main["CUDA_MPS_PIPE_DIRECTORY"] == CONTAINER_MPS_PIPE, main
    assert main["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30", main
    for name in ("ACTIVE_OOM_KILLER", "CUDA_REDIRECT", "CUDA_DEVICE_SM_LIMIT_0"):
        assert main.get(name) != HOSTILE[name], (name, main)
    for side in ("init", "sidecar"):
        theirs = environ(cluster.wait_report("default", "rt-beside", side))
        assert theirs["NVIDIA_VISIBLE_DEVICES"] == "all", theirs  # their own, no card
