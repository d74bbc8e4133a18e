"""Under CDI, a device-plugin grant's limits ride on the daemon's own CDI spec (issue 32).

The kubelet appends the pod spec's env after the device plugin's answer and the runtime
keeps the later value: before the fix, a pod whose spec set
``CUDA_DEVICE_MEMORY_LIMIT_0=99999m`` ran with it. Now, under ``cdi-cri`` or
``cdi-annotations``, each Allocate writes one CDI spec per grant
(``host/grantspecs.py``) carrying the edits, and the answer only names it; the runtime
applies CDI edits after the pod's env and mounts and they replace them
(``tests/kit/cdi_runtime.py`` does what the CDI library does). Real gRPC, the kubelet
stand-in, the specs on disk.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import TESLA_P4, Node, cards, gpu_uuid
from kit.cdi_runtime import final
from kit.procs import poll

from gpushare.daemon import Daemon
from gpushare.host.grantspecs import GrantSpecs, grant_name
from gpushare.share.answers import CONTAINER_LIBRARY

ISSUE_ENV = [
    ("CUDA_DEVICE_MEMORY_LIMIT_0", "99999m"),
    ("CUDA_DEVICE_SM_LIMIT", "100"),
    ("LD_PRELOAD", ""),
    ("CUDA_DISABLE_CONTROL", "true"),
]


def reads_after(daemon: Daemon, count: int, timeout: float = 30.0) -> bool:
    """Wait for ``count`` more successful PodResources reads (each may collect)."""
    assert daemon.core.refresher is not None
    refresher = daemon.core.refresher
    target = refresher.reads + count
    return poll(lambda: refresher.reads >= target, timeout)


def _own(node: Node) -> Path:
    return Path(node.settings.dra_cdi_dir)


def _runtime(node: Node, admitted: Any, pod_env: list[tuple[str, str]]) -> dict[str, str]:
    names: list[str] = []
    for response in admitted.responses.values():
        names += [d.name for d in response.cdi_devices]
        for key, value in response.annotations.items():
            if key.startswith("cdi.k8s.io/"):
                names += value.split(",")
    env, _mounts = final(
        [*admitted.envs.items(), *pod_env],
        [(path, m.host_path) for path, m in admitted.mounts.items()],
        [n for n in dict.fromkeys(names) if not n.startswith("nvidia.com/")],
        [_own(node)],
    )
    return env


@pytest.mark.parametrize("strategy", ["cdi-cri", "cdi-annotations", "envvar,cdi-cri"])
def test_the_pods_own_env_cannot_change_its_limits_under_cdi(node: Node, strategy: str) -> None:
    node.start(cards(TESLA_P4, 1), device_list_strategy=strategy)
    admitted = node.kubelet.admit("tenant", "main", {node.memory: 4, node.core: 30})
    # the answers carry no limit the pod's env could shadow ...
    assert not any(k.startswith("CUDA_") or k == "LD_PRELOAD" for k in admitted.envs)
    assert CONTAINER_LIBRARY not in admitted.mounts
    # ... the runtime's final env has the real ones, whatever the pod spec said
    env = _runtime(node, admitted, ISSUE_ENV)
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{4 * node.settings.memory_unit_mib}m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert env["LD_PRELOAD"] == CONTAINER_LIBRARY
    assert env["NVIDIA_VISIBLE_DEVICES"] == (gpu_uuid(0) if "envvar" in strategy else "void")


def test_each_grant_has_its_own_safely_named_spec_with_the_edits(node: Node) -> None:
    node.start(cards(TESLA_P4, 1), device_list_strategy="cdi-cri")
    admitted = node.kubelet.admit("tenant", "main", {node.memory: 4})
    (response,) = admitted.responses.values()
    names = [d.name for d in response.cdi_devices]
    assert names[0] == f"nvidia.com/gpu={gpu_uuid(0)}"  # the card's, then ours, last
    kind, name = names[-1].split("=")
    assert kind == f"{node.settings.resource_prefix}/grant"
    assert name == grant_name("vcuda-memory", admitted.devices[node.memory])
    spec_file = _own(node) / f"{node.settings.resource_prefix}-grant_{name}.json"
    spec = json.loads(spec_file.read_text())
    (device,) = spec["devices"]
    edits = device["containerEdits"]
    assert f"CUDA_DEVICE_MEMORY_LIMIT_0={4 * node.settings.memory_unit_mib}m" in edits["env"]
    paths = {m["containerPath"]: m["options"][0] for m in edits["mounts"]}
    assert paths[CONTAINER_LIBRARY] == "ro" and paths["/usr/local/vgpu/cache"] == "rw"
    assert oct(spec_file.stat().st_mode & 0o777) == "0o644"


def test_envvar_mode_writes_no_spec(node: Node) -> None:
    node.start(cards(TESLA_P4, 1))
    admitted = node.kubelet.admit("tenant", "main", {node.memory: 4})
    assert admitted.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{4 * node.settings.memory_unit_mib}m"
    assert not _own(node).exists() or not list(_own(node).iterdir())


def test_ended_grants_lose_their_spec_after_the_grace_period_and_held_ones_keep_it(
    tmp_path: Path,
) -> None:
    specs = GrantSpecs(tmp_path, "gpushare.io", grace_seconds=10)
    from gpushare.share.answers import ContainerEdits

    held = specs.write(grant_name("vcuda-memory", ["a"]), ContainerEdits(envs={"X": "1"}))
    ended = specs.write(grant_name("vcuda-core", ["b"]), ContainerEdits(envs={"X": "2"}))
    foreign = tmp_path / "nvidia.com-gpu.json"
    foreign.write_text("{}")
    live = {held.split("=")[1]}
    now = time.time()
    assert specs.collect(live, now) == []  # the grace period starts
    assert specs.collect(live, now + 5) == []
    # written again for a new holder of the same units: its grace period starts again
    os.utime(tmp_path / f"gpushare.io-grant_{ended.split('=')[1]}.json", (now + 8, now + 8))
    assert specs.collect(live, now + 11) == []
    assert specs.collect(live, now + 19) == [ended.split("=")[1]]
    assert specs.names_on_disk() == live
    assert foreign.exists()  # never another producer's spec


def test_the_daemon_removes_a_released_grants_spec_and_keeps_the_held_ones(node: Node) -> None:
    """The collector that buries cache directories removes grant specs too, from the same
    PodResources reads: a released container's specs go after the grace period, a held
    container's stay however long."""
    grace = 0.3
    daemon = node.start(
        cards(TESLA_P4, 1),
        device_list_strategy="cdi-cri",
        gc_grace_seconds=grace,
        pod_resources_interval_seconds=0.05,
    )
    a = node.kubelet.admit("a", "main", {node.memory: 2, node.core: 10})
    b = node.kubelet.admit("b", "main", {node.memory: 3})

    def spec_files(admitted: Any) -> set[Path]:
        names = [n.name for r in admitted.responses.values() for n in r.cdi_devices]
        return {
            _own(node) / f"{node.settings.resource_prefix}-grant_{n.split('=')[1]}.json"
            for n in names
            if "/grant=" in n
        }

    assert len(spec_files(a)) == 2 and all(p.exists() for p in spec_files(a) | spec_files(b))
    assert reads_after(daemon, 4)
    node.kubelet.release("a")
    released = time.monotonic()
    assert poll(lambda: not any(p.exists() for p in spec_files(a)), 30.0)
    assert time.monotonic() - released >= grace
    assert reads_after(daemon, 3)
    assert all(p.exists() for p in spec_files(b))
