"""Under CDI, whole cards, MIG devices and time-sliced replicas are sealed like shared units.

A whole card's container is told its cards by ``NVIDIA_VISIBLE_DEVICES`` (``void`` under a
CDI-only strategy, its UUIDs beside CDI) and, with ``exclusiveEnforcement``, limited by
``CUDA_DEVICE_MEMORY_LIMIT_<i>``. The kubelet appends the pod spec's env after the answer and
the runtime keeps the later value, so a pod asking one card whose spec set
``NVIDIA_VISIBLE_DEVICES=all`` got every card of the node where the NVIDIA runtime reads that
variable. Now every Allocate of an exclusive resource under ``cdi-cri`` or ``cdi-annotations``
writes its own CDI spec (``host/grantspecs.py``), named last in the answer, which carries no
env: the runtime applies it after the pod's env and it replaces it. Real gRPC, the kubelet
stand-in, the specs on disk, the runtime's merge as the CDI library does it
(``tests/kit/cdi_runtime.py``).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import TESLA_P4, Node, cards, gpu_uuid
from kit.cdi_runtime import final
from kit.mig_layouts import mig_uuid, reference_a100
from kit.procs import poll

from gpushare.daemon import Daemon
from gpushare.host.grantspecs import exclusive_grant_name

TENANT_ENV = [
    ("NVIDIA_VISIBLE_DEVICES", "all"),
    ("CUDA_DEVICE_MEMORY_LIMIT_0", "99999m"),
    ("CUDA_DEVICE_MEMORY_LIMIT_1", "99999m"),
]
CDI_STRATEGIES = ["cdi-cri", "cdi-annotations", "envvar,cdi-cri"]


def _own(node: Node) -> Path:
    return Path(node.settings.dra_cdi_dir)


def _names(admitted: Any) -> list[str]:
    names: list[str] = []
    for response in admitted.responses.values():
        names += [d.name for d in response.cdi_devices]
        for key, value in response.annotations.items():
            if key.startswith("cdi.k8s.io/"):
                names += value.split(",")
    return list(dict.fromkeys(names))


def _final_env(node: Node, admitted: Any, pod_env: list[tuple[str, str]]) -> dict[str, str]:
    """The env the runtime finally gives the container: the kubelet's (answers, then the
    pod's), then the daemon's CDI devices (the cards' own specs are not on this node)."""
    env, _mounts = final(
        [*admitted.envs.items(), *pod_env],
        [(path, m.host_path) for path, m in admitted.mounts.items()],
        [n for n in _names(admitted) if not n.startswith("nvidia.com/")],
        [_own(node)],
    )
    return env


def _start(node: Node, gpus: list[dict[str, Any]], resource: str, **overrides: Any) -> None:
    node.write_gpus(gpus)
    node.settings = replace(node.settings, **overrides)
    node.kubelet.start()
    node.daemon = Daemon(node.settings, specs=node.specs)
    node.daemon.start()
    assert node.kubelet.wait_for(lambda k: bool(k.devices(resource)))


@pytest.mark.parametrize("strategy", CDI_STRATEGIES)
@pytest.mark.parametrize("enforced", [False, True])
def test_a_whole_cards_pod_env_cannot_widen_its_cards_or_limits(
    node: Node, strategy: str, enforced: bool
) -> None:
    gpu = f"{node.settings.resource_prefix}/gpu"
    _start(
        node,
        cards(TESLA_P4, 3),
        gpu,
        whole_cards=True,
        device_list_strategy=strategy,
        exclusive_enforcement=enforced,
    )
    admitted = node.kubelet.admit("train", "main", {gpu: 2})
    ids = admitted.devices[gpu]
    assert admitted.envs == {}  # nothing the pod's env could shadow rides on the answer
    grants = [n for n in _names(admitted) if "/grant=" in n]
    assert grants == [
        f"{node.settings.resource_prefix}/grant={exclusive_grant_name(gpu, ids)}"
    ], _names(admitted)
    env = _final_env(node, admitted, TENANT_ENV)
    visible = env["NVIDIA_VISIBLE_DEVICES"]
    assert visible == (",".join(ids) if "envvar" in strategy else "void"), env
    if enforced:
        memory = f"{TESLA_P4['memory_mib']}m"
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == env["CUDA_DEVICE_MEMORY_LIMIT_1"] == memory
        assert env["CUDA_DEVICE_SM_LIMIT"] == "100"


@pytest.mark.parametrize("strategy", CDI_STRATEGIES)
def test_a_mig_devices_pod_env_cannot_widen_its_devices(node: Node, strategy: str) -> None:
    mig = f"{node.settings.resource_prefix}/mig-3g.20gb"
    _start(node, [reference_a100()], mig, mig_strategy="mixed", device_list_strategy=strategy)
    admitted = node.kubelet.admit("infer", "main", {mig: 1})
    assert admitted.devices[mig] == [mig_uuid(0)]
    assert admitted.envs == {}
    assert [n for n in _names(admitted) if "/grant=" in n] == [
        f"{node.settings.resource_prefix}/grant={exclusive_grant_name(mig, [mig_uuid(0)])}"
    ]
    env = _final_env(node, admitted, TENANT_ENV)
    assert env["NVIDIA_VISIBLE_DEVICES"] == (mig_uuid(0) if "envvar" in strategy else "void")


def test_a_time_sliced_replicas_pod_env_cannot_widen_its_card(node: Node) -> None:
    shared = f"{node.settings.resource_prefix}/gpu.shared"
    _start(
        node,
        cards(TESLA_P4, 2),
        shared,
        card_modes="0=timeslice",
        time_slice_replicas="2",
        device_list_strategy="envvar,cdi-cri",
    )
    admitted = node.kubelet.admit("slice", "main", {shared: 1})
    assert admitted.envs == {}
    env = _final_env(node, admitted, TENANT_ENV)
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu_uuid(0)


def test_envvar_strategy_writes_no_spec_for_whole_cards(node: Node) -> None:
    gpu = f"{node.settings.resource_prefix}/gpu"
    _start(node, cards(TESLA_P4, 2), gpu, whole_cards=True)
    admitted = node.kubelet.admit("train", "main", {gpu: 1})
    assert admitted.envs["NVIDIA_VISIBLE_DEVICES"] == admitted.devices[gpu][0]
    assert not _own(node).exists() or not list(_own(node).glob("*grant_*"))


def test_a_released_whole_cards_spec_is_collected_and_a_held_ones_kept(node: Node) -> None:
    gpu = f"{node.settings.resource_prefix}/gpu"
    grace = 0.3
    _start(
        node,
        cards(TESLA_P4, 2),
        gpu,
        whole_cards=True,
        device_list_strategy="cdi-cri",
        gc_grace_seconds=grace,
        pod_resources_interval_seconds=0.05,
    )
    a = node.kubelet.admit("a", "main", {gpu: 1})
    b = node.kubelet.admit("b", "main", {gpu: 1})

    def spec_file(admitted: Any) -> Path:
        (name,) = [n.split("=")[1] for n in _names(admitted) if "/grant=" in n]
        path = _own(node) / f"{node.settings.resource_prefix}-grant_{name}.json"
        assert json.loads(path.read_text())["devices"][0]["name"] == name
        return path

    held, released = spec_file(b), spec_file(a)
    assert node.daemon is not None and node.daemon.core.refresher is not None
    refresher = node.daemon.core.refresher
    target = refresher.reads + 4
    assert poll(lambda: refresher.reads >= target, 30.0)
    assert held.exists() and released.exists()
    node.kubelet.release("a")
    start = time.monotonic()
    assert poll(lambda: not released.exists(), 30.0)
    assert time.monotonic() - start >= grace
    target = refresher.reads + 3
    assert poll(lambda: refresher.reads >= target, 30.0)
    assert held.exists()
