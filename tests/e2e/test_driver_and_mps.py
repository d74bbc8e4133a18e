"""Driver-enforced memory limits and MPS compute caps on the real kubelet, scheduler and DRA
manager (issue 31, "Proof", `make e2e`).

One node is added to the session cluster: ``node-6``, two Tesla P4 on a simulated r615
driver (``driver_version: 615.20.01``, ``nvml_library``: the stand-in libnvidia-ml built
here by gcc from tests/kit/standin/libnvml_standin.c, its limits kept per card and cgroup
path in ``<node>/gpus.yaml.nvml``), the device-list strategy ``cdi-cri``:

* card 0 under the device plugin, memory pinned to ``driver``, compute pinned to ``mps``
  (the control daemon is the stand-in of tests/kit/standin/mps_control.py, with MPS v3
  namespaces, supervised by the daemon);
* card 1 in card mode ``dra``, memory ``driver`` (published as the slice's
  ``memoryEnforcement`` attribute, which the claims here require in their CEL selector).

**The cgroups.** This machine's /sys/fs/cgroup is cgroup v1 (a tmpfs root with v1
controllers), but the kernel's cgroup v2 hierarchy exists (empty of controllers): the node's
mount namespace mounts it at ``<node>/cgroup`` (``NodeSpec.cgroup2``), the CRI fake runs in
that namespace with ``--cgroup-root <node>/cgroup`` and moves each container's process (a
real ``sleep``) into ``k8s.io/<container id>`` there (containerd's path) before it runs the
createRuntime hooks.
So the hook reads the real ``/proc/<pid>/cgroup`` of a real process in a real cgroup v2
directory; only the root path differs from a node's ``/sys/fs/cgroup`` (the daemon is given
it as ``--cgroup-root``, and passes it to the hook as an argument, as it does on a
simulated node). The limit itself lands in the stand-in NVML, not in a driver.

What the real components show:

* every container granted memory on a ``driver`` card (two containers of one pod through
  the device plugin's Allocate, one container through a prepared DRA claim) was created
  only after the daemon's hook, run by the runtime from the CDI spec the kubelet named,
  set a hard limit equal to its grant (soft 0) on that container's own cgroup: one limit
  per container, none shared, none other;
* a hook that fails (card 0 made to refuse limits in the stand-in NVML) fails that
  container's creation (CreateContainerError, the hook's line in the pod's events) and
  nothing else: a pod already running on that card keeps running with its limit, a DRA pod
  on the other card created afterwards runs with its own;
* each container on the MPS card runs with its own MPS namespace's pipe directory, and the
  control daemon holds that namespace capped at the container's cores (the daemon makes and
  caps it before Allocate answers, so before the kubelet asks for the container).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_nodes import TESLA_P4, cards
from kube_cluster import (
    CORE,
    MEMORY,
    PREFIX,
    REPO,
    Cluster,
    NodeSpec,
    load_manifests,
    pod_manifest,
    wait_for,
)

NODE = "node-6"
DRIVER = "gpu.gpushare.io"
RESOURCE = "/apis/resource.k8s.io/v1"
P4S = [{**g, "memory_limits": "ok"} for g in cards(6, TESLA_P4, 2)]
MPS_CARD, DRA_CARD = P4S[0]["uuid"], P4S[1]["uuid"]
UNIT_MIB = 256
CONTAINER_MPS_PIPE = "/tmp/nvidia-mps"  # where a container finds its MPS pipes


def build_standins(out: Path) -> tuple[Path, Path, Path]:
    """The memory hook and the stand-in NVML (gcc), and an ``nvidia-cuda-mps-control`` that
    runs the MPS stand-in with namespaces (v3)."""
    out.mkdir(parents=True, exist_ok=True)
    hook, nvml = out / "gpushare-memory-hook", out / "libnvidia-ml.so.1"
    flags = ["-O2", "-Wall", "-Wextra", "-Werror"]
    subprocess.run(
        ["gcc", *flags, "-o", str(hook), str(REPO / "hook" / "memory-hook.c"), "-ldl"],
        check=True,
        timeout=120,
    )
    standin = REPO / "tests" / "kit" / "standin"
    subprocess.run(
        ["gcc", *flags, "-shared", "-fPIC", "-o", str(nvml), str(standin / "libnvml_standin.c")],
        check=True,
        timeout=120,
    )
    mps = out / "nvidia-cuda-mps-control"
    mps.write_text(
        f'#!/bin/sh\nSTANDIN_MPS_V3=1 exec {sys.executable} {standin / "mps_control.py"} "$@"\n'
    )
    mps.chmod(0o755)
    return hook, nvml, mps


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> Iterator[Path]:
    """node-6 started; yields its directory."""
    hook, nvml, mps = build_standins(cluster.dir / "node-6-standins")
    cluster.api.apply_all(load_manifests(REPO / "daemonset" / "dra" / "rbac.yaml"))
    cluster.api.apply_all(load_manifests(REPO / "daemonset" / "dra" / "deviceclasses.yaml"))
    cdi = cluster.dir / NODE / "cdi"
    cdi.mkdir(parents=True)
    # the cards' own CDI names, as nvidia-ctk or the GPU Operator would write them
    (cdi / "nvidia.com-gpu.json").write_text(
        json.dumps(
            {
                "cdiVersion": "0.5.0",
                "kind": "nvidia.com/gpu",
                "devices": [
                    {"name": g["uuid"], "containerEdits": {"env": ["NVIDIA_SIM_CARD=1"]}}
                    for g in P4S
                ],
            }
        )
    )
    cgroup = cluster.dir / NODE / "cgroup"
    spec = NodeSpec(
        NODE,
        P4S,
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
            f"--cgroup-root={cgroup}",
        ],
        node_file={"driver_version": "615.20.01", "nvml_library": str(nvml)},
        cgroup2=True,
    )
    cluster.add_node(spec)
    try:
        wait_for(f"{NODE}'s slice", lambda: slice_devices(cluster), 60)
        yield cluster.dir / NODE
    finally:
        cluster.remove_node(NODE)
        cluster.api.delete(f"{RESOURCE}/resourceslices", fieldSelector=f"spec.nodeName={NODE}")
        for obj in load_manifests(REPO / "daemonset" / "dra" / "deviceclasses.yaml"):
            cluster.api.delete(cluster.api.path(obj))


def node_labels(cluster: Cluster, key: str) -> dict[str, str]:
    """node-6's labels once ``key`` is among them: the daemon's API link writes them on a
    thread of its own, after the resources registered and the slice went out (what the
    fixture waited for)."""

    def labelled() -> dict[str, str] | None:
        labels = dict(cluster.node(NODE)["metadata"].get("labels") or {})
        return labels if key in labels else None

    return wait_for(f"{NODE}'s label {key}", labelled, 60)


def slice_devices(cluster: Cluster) -> list[dict[str, Any]]:
    items = cluster.api.get(f"{RESOURCE}/resourceslices", fieldSelector=f"spec.nodeName={NODE}")
    return [d for s in items["items"] for d in s["spec"].get("devices", [])]


class Pods:
    """Pods (and their claim templates) a test created, deleted at its end."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.names: list[str] = []
        self.templates: list[str] = []

    def shared(self, name: str, containers: dict[str, dict[str, int]]) -> None:
        self.names.append(name)
        self.cluster.create_pod(pod_manifest(name, containers=containers, node=NODE))

    def claim(self, name: str, memory: str, cores: str) -> None:
        """A pod of one container with a claim of ``memory`` and ``cores`` on a card whose
        memory the driver enforces (the claim's CEL selector says so)."""
        cel = f'device.attributes["{DRIVER}"].memoryEnforcement == "driver"'
        template = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "exactly": {
                                    "deviceClassName": "gpushare.io",
                                    "capacity": {"requests": {"memory": memory, "cores": cores}},
                                    "selectors": [{"cel": {"expression": cel}}],
                                },
                            }
                        ]
                    }
                }
            },
        }
        reply = self.cluster.api.create(template)
        assert reply.status_code == 201, reply.text[:400]
        self.templates.append(name)
        pod = pod_manifest(name, node=NODE)
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": name}]
        pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        self.names.append(name)
        self.cluster.create_pod(pod)

    def cleanup(self) -> None:
        for name in self.names:
            self.cluster.delete_pod("default", name)
        for name in self.templates:
            self.cluster.api.delete(f"{RESOURCE}/namespaces/default/resourceclaimtemplates/{name}")


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[Pods]:
    made = Pods(cluster)
    yield made
    made.cleanup()


def driver_limits(node_dir: Path) -> dict[tuple[str, str], tuple[int, int]]:
    """Every limit the stand-in NVML holds: (card, cgroup path) -> (soft, hard) bytes (its
    files ``limits/<uuid>.<hash>``: "<cgroup>\\n<soft> <hard>\\n")."""
    found = {}
    for path in (node_dir / "gpus.yaml.nvml" / "limits").glob("GPU-*"):
        if path.name.endswith(".tmp"):
            continue
        namespace, numbers = path.read_text().splitlines()[:2]
        soft, hard = (int(n) for n in numbers.split())
        found[(path.name.rsplit(".", 1)[0], namespace)] = (soft, hard)
    return found


def new_limits(
    node_dir: Path, before: dict[tuple[str, str], tuple[int, int]]
) -> dict[tuple[str, str], tuple[int, int]]:
    """The limits set or changed since ``before`` (the stand-in keeps the limits of removed
    cgroups, which a driver drops with the cgroup: earlier tests' containers stay listed)."""
    now = driver_limits(node_dir)
    return dict(now.items() - before.items())


def refuse_limits(node_dir: Path, uuid: str, mode: str) -> None:
    """What the stand-in NVML does with a set on ``uuid`` from now on: ok or unsupported."""
    card = node_dir / "gpus.yaml.nvml" / "cards" / uuid
    tmp = card.with_name(card.name + ".tmp")
    tmp.write_text(mode + "\n")
    tmp.replace(card)


def hook_args(node_dir: Path, record: dict[str, Any]) -> dict[str, str]:
    """The flags of the container's one driver hook (the program the daemon installed in
    its host directory), which ran and exited 0; a DRA claim's container runs the claim's
    limit check too (``--check-limits``, the same program), which passed."""
    hooks = record["hooks"]
    assert all(h["exit_code"] == 0 for h in hooks), hooks
    assert all(h["path"].startswith(f"{node_dir}/vgpu/gpushare-memory-hook") for h in hooks)
    (hook,) = [h for h in hooks if "--check-limits" not in h["args"]]
    args = hook["args"][1:]
    return dict(zip(args[::2], args[1::2], strict=True))


def own_cgroup(node_dir: Path, record: dict[str, Any]) -> str:
    """The container's cgroup: a directory of its own, where its real process is."""
    cgroup = record["cgroup"]
    assert cgroup == f"{node_dir}/cgroup/k8s.io/{record['container_id']}", record
    in_proc = Path(f"/proc/{record['pid']}/cgroup").read_text().splitlines()
    assert f"0::/k8s.io/{record['container_id']}" in in_proc, in_proc
    return str(cgroup)


def test_every_container_gets_its_grant_as_its_own_limit_before_it_starts(
    cluster: Cluster, node: Path, pods: Pods
) -> None:
    labels = node_labels(cluster, f"{PREFIX}/memory-enforcement")
    assert labels[f"{PREFIX}/memory-enforcement"] == "driver", labels
    (published,) = slice_devices(cluster)
    assert published["attributes"]["memoryEnforcement"] == {"string": "driver"}
    before = driver_limits(node)
    assert not [ns for _card, ns in before if "gpushare-selftest" in ns]  # cleared its own

    pods.shared("drv-two", {"big": {MEMORY: 8, CORE: 30}, "small": {MEMORY: 4, CORE: 20}})
    pods.claim("drv-claim", "2Gi", "40")
    for name in pods.names:
        cluster.wait_pod("default", name, "Running")

    expected: dict[tuple[str, str], tuple[int, int]] = {}
    for pod, container, card, mib in [
        ("drv-two", "big", MPS_CARD, 8 * UNIT_MIB),
        ("drv-two", "small", MPS_CARD, 4 * UNIT_MIB),
        ("drv-claim", "main", DRA_CARD, 2048),
    ]:
        record = cluster.wait_record(NODE, "default", pod, container)
        assert record.get("error") is None, record
        # the hook's card and limit are arguments (the tenant writes the env, not these)
        args = hook_args(node, record)
        assert (args["--gpu"], args["--limit-mib"]) == (card, str(mib)), args
        assert not any(k.startswith("CUDA_DEVICE_MEMORY_LIMIT") for k in record["env"])
        expected[(card, own_cgroup(node, record))] = (0, mib << 20)
    # one limit per container, on its own cgroup, equal to its grant; nothing else
    assert new_limits(node, before) == expected


def test_a_failing_hook_fails_that_container_and_nothing_else(
    cluster: Cluster, node: Path, pods: Pods
) -> None:
    before = driver_limits(node)
    pods.shared("keeps-running", {"main": {MEMORY: 6, CORE: 10}})
    cluster.wait_pod("default", "keeps-running", "Running")
    kept = cluster.wait_record(NODE, "default", "keeps-running", "main")
    kept_limit = {(MPS_CARD, own_cgroup(node, kept)): (0, 6 * UNIT_MIB << 20)}
    assert new_limits(node, before) == kept_limit

    refuse_limits(node, MPS_CARD, "unsupported")
    try:
        pods.shared("refused", {"main": {MEMORY: 4, CORE: 10}})

        def create_error() -> dict[str, Any] | None:
            pod = cluster.pod("default", "refused") or {}
            for status in pod.get("status", {}).get("containerStatuses", []):
                waiting = status.get("state", {}).get("waiting") or {}
                if waiting.get("reason") == "CreateContainerError":
                    return waiting
            return None

        waiting = wait_for("refused's CreateContainerError", create_error, 90, step=0.25)
        assert "gpushare-memory-hook" in waiting["message"], waiting
        assert "Not Supported" in waiting["message"], waiting

        def event() -> list[str]:  # the kubelet posts its events on their own
            items = cluster.api.get(
                "/api/v1/namespaces/default/events",
                fieldSelector="involvedObject.name=refused,reason=Failed",
            )["items"]
            return [e["message"] for e in items if "gpushare-memory-hook" in e["message"]]

        assert "Not Supported" in wait_for("the pod's event", event, 60)[0]
        (attempt, *_) = [
            r for r in cluster.nodes[NODE].records() if r["pod"] == "refused"
        ]  # each retry of the kubelet fails the same way
        assert "createRuntime hook" in attempt["error"], attempt
        assert attempt["hooks"][-1]["exit_code"] == 1, attempt["hooks"]
        assert cluster.pod("default", "refused")["status"]["phase"] == "Pending"

        # nothing else: the running pod runs on with its limit, a claim on the other card
        # created now gets its own
        pods.claim("after-refusal", "1Gi", "20")
        cluster.wait_pod("default", "after-refusal", "Running")
        record = cluster.wait_record(NODE, "default", "after-refusal", "main")
        assert record.get("error") is None, record
        after = {(DRA_CARD, own_cgroup(node, record)): (0, 1024 << 20)}
        assert cluster.pod("default", "keeps-running")["status"]["phase"] == "Running"
        assert new_limits(node, before) == kept_limit | after  # none for `refused`
        assert all(r.get("error") is None for r in cluster.nodes[NODE].records()
                   if r["pod"] != "refused")  # fmt: skip
    finally:
        refuse_limits(node, MPS_CARD, "ok")


def test_each_container_on_the_mps_card_runs_under_its_own_capped_namespace(
    cluster: Cluster, node: Path, pods: Pods
) -> None:
    labels = node_labels(cluster, f"{PREFIX}/compute-enforcement.mps")
    assert labels[f"{PREFIX}/compute-enforcement.mps"] == "1", labels
    shares = {"a": 30, "b": 55}
    pods.shared("mps-two", {name: {MEMORY: 2, CORE: cores} for name, cores in shares.items()})
    cluster.wait_pod("default", "mps-two", "Running")
    state = json.loads((node / "vgpu" / "mps" / "pipe" / "standin-state.json").read_text())
    assert state["multi_user"] is True
    pipes = set()
    for name, cores in shares.items():
        record = cluster.wait_record(NODE, "default", "mps-two", name)
        env = record["env"]
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == CONTAINER_MPS_PIPE, env
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(cores), env
        assert "LD_PRELOAD" not in env and "CUDA_DEVICE_SM_LIMIT" not in env, env
        (mount,) = [m for m in record["mounts"] if m["container_path"] == CONTAINER_MPS_PIPE]
        assert mount["readonly"] is True, mount  # nothing a tenant plants for the root server
        pipe = mount["host_path"]
        (namespace,) = [n for n in state["namespaces"].values() if n["pipe"] == pipe]
        assert namespace["percent"] == cores, namespace
        pipes.add(pipe)
    assert len(pipes) == 2  # one namespace per container
