"""MPS compute shares end to end: the daemon on a simulated node with the MPS control
daemon's stand-in on its configured path, the stand-in kubelet admitting containers over
real sockets. Each container's namespace is made and capped at its cores BEFORE its
answer leaves (so before it can make a CUDA call), only its own pipe directory is
mounted, no interposer is loaded; without namespaces the control daemon's pipe and the
client caps are given; the control daemon is stopped with the daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import H200, Node, cards, gpu_uuid
from kit.mps import install_standin, pid_alive, standin_state

from gpushare.host.mps import SERVER, mps_dirs
from gpushare.share.answers import (
    CONTAINER_MPS_PIPE,
    MPS_PINNED_MEMORY,
    MPS_PIPE,
    MPS_THREADS,
)


def start_mps(node: Node, **overrides: object) -> Path:
    exe = install_standin(node.root / "bin")
    node.with_pod_specs()
    node.start(cards(H200, 2), mps_control=str(exe), **overrides)
    return mps_dirs(Path(node.settings.host_lib_dir))[0]


@pytest.mark.parametrize("order", ["memory-first", "core-first"])
def test_each_container_gets_its_own_capped_namespace(
    node: Node, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    monkeypatch.setenv("STANDIN_MPS_V3", "1")
    control_pipe = start_mps(node)
    assert node.daemon is not None and "mps-control" in node.daemon.parts
    core = node.daemon.core
    assert core is not None
    assert {c.compute.value for c in core.backends.values()} == {"mps"}
    assert {c.memory.value for c in core.backends.values()} == {"soft"}
    resources = [node.memory, node.core]
    if order == "core-first":
        resources.reverse()
    admitted = {}
    for name, (mem, cores) in {"a": (40, 30), "b": (8, 70)}.items():
        node.pod(name, {node.memory: mem, node.core: cores})
        admitted[name] = node.kubelet.admit(
            name, "main", {node.memory: mem, node.core: cores}, order=resources
        )
    namespaces = standin_state(control_pipe)["namespaces"]
    assert len(namespaces) == 2
    pipes = set()
    for name, (mem, cores) in {"a": (40, 30), "b": (8, 70)}.items():
        got = admitted[name]
        assert got.envs[MPS_PIPE] == CONTAINER_MPS_PIPE
        assert got.envs[MPS_THREADS] == str(cores)
        assert got.envs[MPS_PINNED_MEMORY] == f"0={mem * 256}M"
        assert "LD_PRELOAD" not in got.envs and "CUDA_DEVICE_SM_LIMIT" not in got.envs
        # only its own pipe directory, and the shared memory MPS passes work through
        assert sorted(got.mounts) == sorted([CONTAINER_MPS_PIPE, "/dev/shm"])
        shm = got.mounts["/dev/shm"].host_path
        assert shm == str(Path(node.settings.host_lib_dir) / "mps" / "shm")
        pipe = got.mounts[CONTAINER_MPS_PIPE].host_path
        # its namespace's directory on the one server (the documented v3 routing), made
        # before the answer left, mounted read-only (nothing a tenant could plant there)
        assert Path(pipe).parent == control_pipe / SERVER
        assert (Path(pipe) / "control").is_socket()
        assert got.mounts[CONTAINER_MPS_PIPE].read_only
        assert not got.mounts["/dev/shm"].read_only  # clients write their segments
        pipes.add(pipe)
        (ns,) = [n for n in namespaces.values() if n["pipe"] == pipe]
        assert ns == {"pipe": pipe, "percent": cores, "mib": mem * 256}
        assert not got.conflicts
    assert len(pipes) == 2


def test_without_namespaces_the_control_pipe_and_client_caps(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STANDIN_MPS_V3", raising=False)
    control_pipe = start_mps(node)
    node.pod("a", {node.memory: 4, node.core: 25})
    got = node.kubelet.admit("a", "main", {node.memory: 4, node.core: 25})
    assert got.mounts[CONTAINER_MPS_PIPE].host_path == str(control_pipe)
    assert got.mounts[CONTAINER_MPS_PIPE].read_only  # shared by every client: never writable
    assert got.envs[MPS_THREADS] == "25" and got.envs[MPS_PINNED_MEMORY] == "0=1024M"
    assert standin_state(control_pipe)["namespaces"] == {}


def test_a_pin_to_mps_without_a_control_daemon_refuses_the_start(node: Node) -> None:
    from gpushare.base.startup import StartupError

    with pytest.raises(StartupError, match="no MPS control daemon"):
        node.start(cards(H200, 1), compute_enforcement="mps")


def test_only_pinned_cards_use_mps_and_the_daemon_stops_it(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_MPS_V3", "1")
    control_pipe = start_mps(node, compute_enforcement="interposer,1=mps")
    assert node.daemon is not None and node.daemon.core is not None
    backends = node.daemon.core.backends
    assert backends[gpu_uuid(0)].compute.value == "interposer"
    assert backends[gpu_uuid(1)].compute.value == "mps"
    pid = standin_state(control_pipe)["pid"]
    assert pid_alive(pid)
    node.daemon.stop()
    node.daemon = None
    assert not pid_alive(pid)


def test_the_chart_shares_dev_shm_with_mps_clients_only_when_mps_is_on() -> None:
    from test_deploy_manifests import chart_objects, chart_values, one

    def daemon_pod(values: dict[str, object]) -> dict[str, object]:
        daemonset = one(chart_objects(values), "DaemonSet")
        spec: dict[str, object] = daemonset["spec"]["template"]["spec"]
        return spec

    off = daemon_pod(chart_values())
    assert "mps-shm" not in str(off)
    values = chart_values()
    values["config"]["mpsControl"] = "/usr/bin/nvidia-cuda-mps-control"  # type: ignore[index]
    on = daemon_pod(values)
    (container,) = [c for c in on["containers"] if c["name"] == "gpushare"]  # type: ignore[attr-defined]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["mps-shm"] == "/dev/shm"
    volumes = {v["name"]: v for v in on["volumes"]}  # type: ignore[attr-defined]
    assert volumes["mps-shm"]["hostPath"]["path"] == "/usr/local/vgpu/mps/shm"


def test_a_dra_claim_on_an_mps_card_gets_its_own_capped_namespace(
    node: Node, api: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import NODE, TESLA_P4
    from kit.procs import poll

    from gpushare.sim.drakubeletdouble import DraKubelet, allocated_claim

    monkeypatch.setenv("STANDIN_MPS_V3", "1")
    exe = install_standin(node.root / "bin")
    node.start(
        cards(TESLA_P4, 2),
        card_modes="0=dra",
        node_name=NODE,
        dra_kubelet_root=str(node.root / "kubelet"),
        dra_cdi_dir=str(node.root / "cdi"),
        mps_control=str(exe),
        compute_enforcement="0=mps",
    )
    assert node.daemon is not None
    registrar = DraKubelet(node.root / "kubelet")  # slices follow the registration
    assert registrar.register() == "v1.DRAPlugin"
    registrar.close()
    assert poll(lambda: "dra" not in node.daemon.readiness()[1], 30)  # type: ignore[union-attr]
    result = {
        "request": "r",
        "device": "gpu-0",
        "consumedCapacity": {"memory": "1Gi", "cores": "40"},
    }
    uid = api.add(allocated_claim("default", "a", "gpu.gpushare.io", NODE, [result]))["metadata"][
        "uid"
    ]
    kubelet = DraKubelet(node.root / "kubelet")
    try:
        assert kubelet.register() == "v1.DRAPlugin"
        prepared = kubelet.prepare([("default", "a", uid)])
    finally:
        kubelet.close()
    assert prepared[uid].error == "", prepared[uid].error
    spec = json.loads((node.root / "cdi" / f"gpu.gpushare.io-claim_{uid}.json").read_text())
    (edits,) = [d["containerEdits"] for d in spec["devices"]]
    env = dict(e.split("=", 1) for e in edits["env"])
    assert env[MPS_PIPE] == CONTAINER_MPS_PIPE and env[MPS_THREADS] == "40"
    assert "LD_PRELOAD" not in env
    (mount,) = [m for m in edits["mounts"] if m["containerPath"] == CONTAINER_MPS_PIPE]
    assert "ro" in mount["options"]
    pipe = [mount["hostPath"]]
    control_pipe = mps_dirs(Path(node.settings.host_lib_dir))[0]
    (ns,) = standin_state(control_pipe)["namespaces"].values()
    assert pipe == [ns["pipe"]] and ns["percent"] == 40 and ns["mib"] == 1024


def test_the_shared_dev_shm_is_swept_only_once_no_client_lives(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41 item 2, wired: the daemon measures the MPS /dev/shm at each GC pass and
    removes a left segment only when the kubelet's records show no MPS client."""
    import os

    from gpushare.host.mps import mps_shm_dir
    from gpushare.share.devices import Resource
    from gpushare.share.records import Snapshot
    from gpushare.share.usage import Holder

    monkeypatch.delenv("STANDIN_MPS_V3", raising=False)
    start_mps(node)
    assert node.daemon is not None and node.daemon.core is not None
    core = node.daemon.core
    assert core.mps_shm is not None
    # what the daemon's pod sees of /proc: itself (here the test process) and the MPS
    # control daemon it runs (this machine's pid 1 is not a process of that pod)
    seen = node.root / "proc-seen"
    seen.mkdir()
    control = standin_state(mps_dirs(Path(node.settings.host_lib_dir))[0])["pid"]
    for pid in (os.getpid(), control):
        (seen / str(pid)).symlink_to(f"/proc/{pid}")
    core.mps_shm.proc_root = seen
    shm = mps_shm_dir(Path(node.settings.host_lib_dir))
    left = shm / "cuda.shm.999.1"
    left.write_bytes(b"x" * 8192)
    os.utime(left, (0, 0))
    client = Holder("t", "a", "main")
    live = Snapshot(0.0, holders={(Resource.MEMORY, f"{gpu_uuid(0)}::3"): client})
    core.sweep_mps_shm(live)
    assert left.exists() and core.mps_shm.state.usage.bytes >= 8192
    core.sweep_mps_shm(Snapshot(0.0))
    assert not left.exists() and core.mps_shm.state.removed_total == 1
