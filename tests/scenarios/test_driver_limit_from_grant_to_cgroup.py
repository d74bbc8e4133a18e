"""The ``driver`` memory backend end to end, without a GPU: the daemon decides it at start
on a simulated r615 node (self-test against the simulated NVML), a DRA claim is prepared
through the kubelet's gRPC socket, the claim's CDI spec carries the createRuntime hook
with the card and the grant in its arguments, the hook (built by gcc) is run as the
runtime runs it, with an OCI state on stdin, and the limit lands in the simulated driver,
on the container's own cgroup, equal to the grant. A card the hook cannot serve fails
that container alone."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import NODE, TESLA_P4, Node, cards, gpu_uuid
from kit.memhook import HAVE_GCC, build, oci_state
from kit.procs import poll

from gpushare.base.startup import NodeConfigurationError
from gpushare.gpu.memlimits import LimitStore, MemoryLimits
from gpushare.share.backendchoice import MemoryBackend
from gpushare.sim.apidouble import KubeApiDouble
from gpushare.sim.drakubeletdouble import DraKubelet, allocated_claim

pytestmark = pytest.mark.skipif(not HAVE_GCC, reason="needs gcc")
DRIVER = "gpu.gpushare.io"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build(tmp_path_factory.mktemp("hook"))


def start_r615(
    node: Node, built: tuple[Path, Path], strategy: str = "envvar", **modes: str
) -> LimitStore:
    """Two cards, card 0 in DRA mode, on a simulated r615 node with cgroup v2; card 1
    under the device plugin (``driver`` too with a CDI ``strategy``)."""
    hook, nvml = built
    cgroup = node.root / "cgroup"
    cgroup.mkdir()
    (cgroup / "cgroup.controllers").write_text("cpu memory\n")

    def write_gpus(gpus: list[dict[str, Any]]) -> None:
        for entry in gpus:
            entry["memory_limits"] = modes.get(entry["uuid"], "ok")
        node.gpus_file.write_text(
            yaml.safe_dump({"gpus": gpus, "driver_version": "615.20.01", "nvml_library": str(nvml)})
        )

    node.write_gpus = write_gpus  # type: ignore[method-assign]
    node.start(
        cards(TESLA_P4, 2),
        card_modes="0=dra",
        node_name=NODE,
        dra_kubelet_root=str(node.root / "kubelet"),
        dra_cdi_dir=str(node.root / "cdi"),
        cgroup_root=str(cgroup),
        memory_hook=str(hook),
        device_list_strategy=strategy,
    )
    return LimitStore(node.gpus_file.with_name("node.yaml.nvml"))


def run_hooks(spec: dict[str, Any], proc: Path, pid: int) -> list[subprocess.CompletedProcess[str]]:
    """Every createRuntime hook of the spec's devices, as the runtime runs them (the
    stand-in /proc given where the real one would be read)."""
    results = []
    for device in spec["devices"]:
        for hook in driver_hooks(device["containerEdits"]):
            assert hook["hookName"] == "createRuntime"
            env = dict(e.split("=", 1) for e in hook.get("env", []))
            results.append(
                subprocess.run(
                    [hook["path"], *hook["args"][1:], "--proc-root", str(proc)],
                    input=json.dumps(oci_state(pid)),
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=60,
                )
            )
    return results


def driver_hooks(edits: dict[str, Any]) -> list[dict[str, Any]]:
    """The hooks that set a driver limit (a DRA claim's spec has the limit check too)."""
    return [h for h in edits.get("hooks", []) if "--gpu" in h["args"]]


def limit_check(edits: dict[str, Any]) -> list[str]:
    """The limit check's arguments after ``--check-limits`` (the one such hook)."""
    (check,) = [h for h in edits.get("hooks", []) if "--check-limits" in h["args"]]
    return list(check["args"][2:])


def container(node: Node, pid: int, path: str) -> str:
    (node.root / "cgroup" / path.lstrip("/")).mkdir(parents=True)
    (node.root / "proc" / str(pid)).mkdir(parents=True)
    (node.root / "proc" / str(pid) / "cgroup").write_text(f"0::{path}\n")
    return f"{node.root / 'cgroup'}{path}"


def prepare(node: Node, api: KubeApiDouble, name: str, memory: str) -> dict[str, Any]:
    result = {"request": "r", "device": "gpu-0", "consumedCapacity": {"memory": memory}}
    obj = api.add(allocated_claim("default", name, DRIVER, NODE, [result]))
    uid = obj["metadata"]["uid"]
    kubelet = DraKubelet(node.root / "kubelet")
    try:
        assert kubelet.register() == "v1.DRAPlugin"
        prepared = kubelet.prepare([("default", name, uid)])
    finally:
        kubelet.close()
    assert prepared[uid].error == "", prepared[uid].error
    spec: dict[str, Any] = json.loads(
        (node.root / "cdi" / f"{DRIVER}-claim_{uid}.json").read_text()
    )
    return spec


def test_a_claim_on_a_driver_card_gets_its_limit_on_its_own_cgroup(
    node: Node, api: KubeApiDouble, built: tuple[Path, Path]
) -> None:
    store = start_r615(node, built)
    assert node.daemon is not None
    backends = node.daemon.core.backends
    assert backends[gpu_uuid(0)].memory is MemoryBackend.DRIVER  # DRA: its own CDI spec
    assert backends[gpu_uuid(1)].memory is MemoryBackend.INTERPOSER  # the device plugin's
    assert store.limits() == {}  # the self-test cleared its limit
    registrar = DraKubelet(node.root / "kubelet")  # slices follow the registration
    assert registrar.register() == "v1.DRAPlugin"
    registrar.close()
    assert poll(lambda: "dra" not in node.daemon.readiness()[1], 30)  # type: ignore[union-attr]

    # published for claims to select (CEL: device.attributes[...].memoryEnforcement)
    found = api.get("ResourceSlice", f"{NODE}-{DRIVER}-0", api_version="resource.k8s.io/v1")
    (device,) = (found or {})["spec"]["devices"]
    assert device["attributes"]["memoryEnforcement"] == {"string": "driver"}
    assert device["attributes"]["computeEnforcement"] == {"string": "interposer"}

    spec_a = prepare(node, api, "a", "2Gi")
    spec_b = prepare(node, api, "b", "1Gi")
    (edits,) = [d["containerEdits"] for d in spec_a["devices"]]
    assert "CUDA_DEVICE_MEMORY_LIMIT_0=2048m" not in edits.get("env", [])  # not libvgpu's
    (hook,) = driver_hooks(edits)
    assert hook["args"][1:5] == ["--gpu", gpu_uuid(0), "--limit-mib", "2048"]  # in the args
    # compute stays with the interposer: the claim's check holds the switches, not memory
    assert "--memory-mib" not in limit_check(edits) and "--neutral" in limit_check(edits)

    a = container(node, 101, "/kubepods/pod-a/ctr")
    b = container(node, 102, "/kubepods/pod-b/ctr")
    assert [r.returncode for r in run_hooks(spec_a, node.root / "proc", 101)] == [0]
    assert [r.returncode for r in run_hooks(spec_b, node.root / "proc", 102)] == [0]
    assert store.limits() == {
        (gpu_uuid(0), a): MemoryLimits(0, 2048 << 20),
        (gpu_uuid(0), b): MemoryLimits(0, 1024 << 20),
    }


def test_a_card_whose_driver_forgets_fails_that_container_alone(
    node: Node, api: KubeApiDouble, built: tuple[Path, Path]
) -> None:
    store = start_r615(node, built)
    spec_a = prepare(node, api, "a", "2Gi")
    spec_b = prepare(node, api, "b", "1Gi")
    a = container(node, 101, "/kubepods/pod-a/ctr")
    container(node, 102, "/kubepods/pod-b/ctr")
    assert [r.returncode for r in run_hooks(spec_a, node.root / "proc", 101)] == [0]
    # the driver stops keeping limits (after the start-up self-test): b's hook fails
    data = yaml.safe_load(node.gpus_file.read_text())
    store.publish("615.20.01", {data["gpus"][0]["uuid"]: "broken", data["gpus"][1]["uuid"]: "ok"})
    (failed,) = run_hooks(spec_b, node.root / "proc", 102)
    assert failed.returncode == 1 and "reads back nothing" in failed.stderr
    assert store.limits() == {(gpu_uuid(0), a): MemoryLimits(0, 2048 << 20)}  # a's untouched


def test_a_card_that_fails_its_self_test_is_not_driver(
    node: Node, api: KubeApiDouble, built: tuple[Path, Path]
) -> None:
    start_r615(node, built, **{gpu_uuid(0): "broken"})
    assert node.daemon is not None
    choice = node.daemon.core.backends[gpu_uuid(0)]
    assert choice.memory is MemoryBackend.INTERPOSER
    assert "self-test failed" in choice.memory_reason
    spec = prepare(node, api, "a", "2Gi")
    (edits,) = [d["containerEdits"] for d in spec["devices"]]
    assert driver_hooks(edits) == [] and "CUDA_DEVICE_MEMORY_LIMIT_0=2048m" in edits["env"]
    assert limit_check(edits)[:2] == ["--memory-mib", "2048"]  # the interposer's, checked


def test_pinned_driver_on_a_device_plugin_card_stops_the_start(
    node: Node, api: KubeApiDouble, built: tuple[Path, Path]
) -> None:
    node.settings = replace(node.settings, memory_enforcement="1=driver")
    with pytest.raises(NodeConfigurationError, match=r"card 1 .* to driver.*no CDI") as caught:
        start_r615(node, built)
    assert "\n" not in str(caught.value)


def test_a_device_plugin_grant_under_cdi_gets_its_limit_from_its_own_spec(
    node: Node, api: KubeApiDouble, built: tuple[Path, Path]
) -> None:
    store = start_r615(node, built, strategy="cdi-cri")
    assert node.daemon is not None
    assert node.daemon.core.backends[gpu_uuid(1)].memory is MemoryBackend.DRIVER
    admitted = node.kubelet.admit("tenant", "main", {node.memory: 6, node.core: 30})
    names = [d.name for r in admitted.responses.values() for d in r.cdi_devices]
    grants = [
        n.split("=", 1)[1] for n in names if n.startswith(f"{node.settings.resource_prefix}/grant=")
    ]
    specs = [
        json.loads(
            (node.root / "cdi" / f"{node.settings.resource_prefix}-grant_{g}.json").read_text()
        )
        for g in dict.fromkeys(grants)
    ]
    hooks = [h for s in specs for d in s["devices"] for h in d["containerEdits"].get("hooks", [])]
    (hook,) = hooks  # the memory grant's spec only
    limit = 6 * node.settings.memory_unit_mib
    assert hook["args"][1:5] == ["--gpu", gpu_uuid(1), "--limit-mib", str(limit)]
    env = [e for s in specs for d in s["devices"] for e in d["containerEdits"].get("env", [])]
    assert not any(e.startswith("CUDA_DEVICE_MEMORY_LIMIT") for e in env)
    assert "CUDA_DEVICE_SM_LIMIT=30" in env  # compute stays with the interposer
    cgroup = container(node, 201, "/kubepods/pod-t/main")
    results = [r for s in specs for r in run_hooks(s, node.root / "proc", 201)]
    assert [r.returncode for r in results] == [0], [r.stderr for r in results]
    assert store.limits() == {(gpu_uuid(1), cgroup): MemoryLimits(0, limit << 20)}


def holder_of(spec: dict[str, Any]) -> Path:
    """The claim share's holder directory its driver hook names (``--holder``)."""
    ((hook,),) = [driver_hooks(d["containerEdits"]) for d in spec["devices"]]
    return Path(hook["args"][hook["args"].index("--holder") + 1])


def test_a_claim_on_a_driver_card_serves_one_live_container_at_a_time(
    node: Node, api: KubeApiDouble, built: tuple[Path, Path]
) -> None:
    """Issue 41 item 1: one claim's charge, one driver limit at a time. Two containers
    using one claim (two pods reserving it, or two containers of one pod) each got the
    whole charge as a limit on its own cgroup; the second is now refused at createRuntime
    while the first one's cgroup holds a process, and starts once it has ended (a
    restart is a new container in a new cgroup)."""
    store = start_r615(node, built)
    spec = prepare(node, api, "shared", "1Gi")
    proc = node.root / "proc"
    first = container(node, 101, "/kubepods/pod-a/main")
    assert [r.returncode for r in run_hooks(spec, proc, 101)] == [0]

    container(node, 102, "/kubepods/pod-b/main")  # a second pod reserving the claim
    container(node, 103, "/kubepods/pod-a/sidecar")  # or a second container of the pod
    for pid in (102, 103):
        (refused,) = run_hooks(spec, proc, pid)
        assert refused.returncode == 1
        assert "held by another running container" in refused.stderr
        assert "its own claim" in refused.stderr  # what to do instead
    assert store.limits() == {(gpu_uuid(0), first): MemoryLimits(0, 1024 << 20)}  # one charge

    # the first container ends (its cgroup empties, then goes): the claim is free again
    (Path(first) / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    restarted = container(node, 104, "/kubepods/pod-a/main-restarted")
    assert [r.returncode for r in run_hooks(spec, proc, 104)] == [0]
    (node.root / "cgroup" / "kubepods/pod-a/main-restarted").rename(node.root / "cgroup" / "gone")
    assert [r.returncode for r in run_hooks(spec, proc, 102)] == [0]
    assert (gpu_uuid(0), restarted) in store.limits()


def test_the_claims_holder_record_is_out_of_every_tenants_reach(
    node: Node, api: KubeApiDouble, built: tuple[Path, Path]
) -> None:
    """The record lives in a directory of the daemon's own (0700, on the host's disk, not
    mounted into any container); a hook that fails after taking it gives it back; the
    directory goes when the claim is unprepared."""
    store = start_r615(node, built)
    spec = prepare(node, api, "shared", "1Gi")
    holder = holder_of(spec)
    assert holder.stat().st_mode & 0o777 == 0o700
    mounted = [
        Path(m["hostPath"]) for d in spec["devices"] for m in d["containerEdits"].get("mounts", [])
    ]
    assert not any(holder.is_relative_to(m) or m.is_relative_to(holder) for m in mounted)
    assert not holder.is_relative_to(node.root / "vgpu" / "containers")  # a tenant can fill it

    # the driver stops keeping limits: the hook fails and leaves no record behind
    proc = node.root / "proc"
    container(node, 101, "/kubepods/pod-a/main")
    data = yaml.safe_load(node.gpus_file.read_text())
    store.publish("615.20.01", {data["gpus"][0]["uuid"]: "broken", data["gpus"][1]["uuid"]: "ok"})
    (failed,) = run_hooks(spec, proc, 101)
    assert failed.returncode == 1 and not (holder / "holder").exists()
    store.publish("615.20.01", {data["gpus"][0]["uuid"]: "ok", data["gpus"][1]["uuid"]: "ok"})
    container(node, 102, "/kubepods/pod-b/main")
    assert [r.returncode for r in run_hooks(spec, proc, 102)] == [0]
    assert (holder / "holder").read_text() == "/kubepods/pod-b/main\n"

    # a holder directory that is not the daemon's (mode opened up): refused, fail closed
    holder.chmod(0o777)
    (refused,) = run_hooks(spec, proc, 101)
    assert refused.returncode == 1 and "not the hook's own" in refused.stderr
    holder.chmod(0o700)

    kubelet = DraKubelet(node.root / "kubelet")
    try:
        assert kubelet.register() == "v1.DRAPlugin"
        uid = spec["devices"][0]["name"].split("-r-")[0]
        assert kubelet.unprepare([("default", "shared", uid)])[uid] == ""
    finally:
        kubelet.close()
    assert not holder.exists()


def test_containers_of_one_claim_started_at_once_get_one_limit(
    node: Node, api: KubeApiDouble, built: tuple[Path, Path]
) -> None:
    """Eight containers of one claim whose hooks run at the same moment (a pod of eight
    containers listing the claim): the holder lock lets exactly one through."""
    store = start_r615(node, built)
    spec = prepare(node, api, "wide", "1Gi")
    ((hook,),) = [driver_hooks(d["containerEdits"]) for d in spec["devices"]]
    env = dict(e.split("=", 1) for e in hook.get("env", []))
    proc = node.root / "proc"
    running = []
    for pid in range(301, 309):
        container(node, pid, f"/kubepods/pod-w/c{pid}")
        started = subprocess.Popen(
            [hook["path"], *hook["args"][1:], "--proc-root", str(proc)],
            stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
        )  # fmt: skip
        running.append(started)
    for started in running:
        assert started.stdin is not None
        started.stdin.write(json.dumps(oci_state(301 + running.index(started))))
        started.stdin.close()
    codes = sorted(started.wait(timeout=60) for started in running)
    for started in running:
        assert started.stderr is not None
        started.stderr.close()
    assert codes == [0] + [1] * 7
    assert len(store.limits()) == 1  # one charge on the card
