"""The ``driver`` backend is tested where containers live (issue 41 item 4).

On the kernel's ``dmem`` backend a limit can only be set on a cgroup whose every level
above enables ``+dmem`` (NVML answers NOT_FOUND elsewhere); the kubelet makes containers
under ``kubepods[.slice]/<qos>/<pod>/``, and nobody enables ``dmem`` there. A fake cgroup
tree (a temp directory laid out like ``/sys/fs/cgroup`` for either cgroup driver) and the
simulated NVML in its ``dmem`` mode (the same chain rule as the C stand-in the hook loads)
show the daemon's decision: ``driver`` only where a container's cgroup can really carry a
limit, else the interposer with the level that breaks the chain and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
import yaml

from gpushare.base.startup import NodeConfigurationError
from gpushare.config import Settings
from gpushare.gpu.memlimits import NVML_ERROR_NOT_FOUND, MemoryLimitError
from gpushare.gpu.simulated import SimulatedBackend
from gpushare.node.backendfacts import card_traits, decide_backends
from gpushare.node.podcgroups import memacct_backend, pod_cgroups
from gpushare.share.backendchoice import MemoryBackend
from gpushare.share.cardmodes import CardMode

A, B = "GPU-aaaa", "GPU-bbbb"
BUS = {A: "00000000:3B:00.0", B: "00000000:86:00.0"}
#: (the kubelet's levels, a pod's cgroup, a container's cgroup) per cgroup driver
LAYOUTS = {
    "systemd": (
        ["kubepods.slice", "kubepods.slice/kubepods-burstable.slice",
         "kubepods.slice/kubepods-besteffort.slice"],
        "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f1e.slice",
        "cri-containerd-4b5c.scope",
    ),
    "cgroupfs": (
        ["kubepods", "kubepods/burstable", "kubepods/besteffort"],
        "kubepods/besteffort/pod0f1e",
        "4b5c",
    ),
}  # fmt: skip


def node_file(tmp_path: Path, mode: str = "dmem") -> Path:
    gpus = [
        {"uuid": uuid, "memory_mib": 16384, "memory_limits": mode, "pci_bus_id": bus, "index": i}
        for i, (uuid, bus) in enumerate(BUS.items())
    ]
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump({"gpus": gpus, "driver_version": "615.20.01"}))
    return path


def cgroup_tree(tmp_path: Path, driver: str, without_dmem: str | None, dmem_cards: bool = True
                ) -> tuple[Path, Path]:  # fmt: skip
    """(the root, a container's cgroup): every level enables dmem but ``without_dmem``
    ("" the root, else a path under it); the root lists both cards as dmem regions."""
    root = tmp_path / "cgroup"
    levels, pod, leaf = LAYOUTS[driver]
    for level in ["", *levels, pod]:
        (root / level).mkdir(parents=True, exist_ok=True)
        words = "cpu io memory pids" if level == without_dmem else "cpu io memory pids dmem"
        (root / level / "cgroup.subtree_control").write_text(words + "\n")
    (root / "cgroup.controllers").write_text("cpu io memory pids dmem\n")
    if dmem_cards:
        (root / "dmem.capacity").write_text(
            "".join(f"nvidia/0000:{b[9:].lower()}/vidmem 17179869184\n" for b in BUS.values())
        )
    container = root / pod / leaf
    container.mkdir()
    return root, container


def decide(backend: SimulatedBackend, root: Path, pin: str = "auto") -> dict:  # type: ignore[type-arg]
    settings = Settings(simulate=str(backend.path), cgroup_root=str(root),  # type: ignore[arg-type]
                        device_list_strategy="cdi-cri", memory_enforcement=pin)  # fmt: skip
    gpus = backend.discover()
    traits = card_traits(gpus, [], {g.uuid: CardMode.BOTH for g in gpus}, uses_cdi=True)
    return decide_backends(settings, backend, traits)


@pytest.mark.parametrize("driver", sorted(LAYOUTS))
@pytest.mark.parametrize("broken", ["kubelet level", "pod"])
def test_a_dmem_chain_broken_where_containers_live_refuses_driver(
    tmp_path: Path, driver: str, broken: str
) -> None:
    levels, pod, _leaf = LAYOUTS[driver]
    without = levels[0] if broken == "kubelet level" else pod
    root, container = cgroup_tree(tmp_path, driver, without)
    backend = SimulatedBackend(node_file(tmp_path))
    # what every container's hook would meet: the driver answers NOT_FOUND there
    with pytest.raises(MemoryLimitError) as refused:
        backend.set_memory_limits(A, str(container), 0, 1 << 30)
    assert refused.value.code == NVML_ERROR_NOT_FOUND
    # (a scratch cgroup at the root, as the self-test made it before, would have passed)
    (root / "scratch").mkdir()
    backend.set_memory_limits(A, str(root / "scratch"), 0, 1 << 30)
    choices = decide(backend, root)
    for uuid in (A, B):
        assert choices[uuid].memory is MemoryBackend.INTERPOSER
        reason = choices[uuid].memory_reason
        assert f"/{without} does not enable it" in reason and "RmMemacctMode=1" in reason
        assert f"({driver} cgroup driver)" in reason
    with pytest.raises(NodeConfigurationError, match=f"/{without} does not enable it"):
        decide(backend, root, pin="driver")


@pytest.mark.parametrize("driver", sorted(LAYOUTS))
def test_a_whole_dmem_chain_gives_driver_tested_beside_the_pods(
    tmp_path: Path, driver: str
) -> None:
    root, container = cgroup_tree(tmp_path, driver, None)
    backend = SimulatedBackend(node_file(tmp_path))
    with structlog.testing.capture_logs() as logs:
        choices = decide(backend, root)
    assert {c.memory for c in choices.values()} == {MemoryBackend.DRIVER}
    tested = {e["tested_at"] for e in logs if e["event"] == "driver_memacct"}
    assert tested == {str(root / LAYOUTS[driver][0][-1])}  # the QoS level, not the root
    assert {e["backend"] for e in logs if e["event"] == "driver_memacct"} == {"dmem"}
    backend.set_memory_limits(A, str(container), 0, 1 << 30)  # a container's hook holds
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("gpushare")) == []


def test_the_misc_backend_needs_no_chain(tmp_path: Path) -> None:
    """Without a dmem region of the card (the driver's own map, RmMemacctMode=1 or a
    kernel before 6.14) nothing in cgroup.subtree_control matters."""
    root, container = cgroup_tree(tmp_path, "systemd", "kubepods.slice", dmem_cards=False)
    backend = SimulatedBackend(node_file(tmp_path, mode="ok"))
    assert memacct_backend(root, BUS[A]) == "misc"
    choices = decide(backend, root)
    assert {c.memory for c in choices.values()} == {MemoryBackend.DRIVER}
    backend.set_memory_limits(A, str(container), 0, 1 << 30)


def test_dmem_without_the_kubelets_cgroups_is_not_driver(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory dmem\n")
    (root / "cgroup.subtree_control").write_text("cpu memory dmem\n")
    (root / "dmem.capacity").write_text("nvidia/0000:3b:00.0/vidmem 1\n")
    backend = SimulatedBackend(node_file(tmp_path))
    choices = decide(backend, root)
    assert choices[A].memory is MemoryBackend.INTERPOSER
    assert "cannot be checked" in choices[A].memory_reason
    assert choices[B].memory is MemoryBackend.DRIVER  # its region is not listed: misc


def test_the_layouts_are_found(tmp_path: Path) -> None:
    for driver in LAYOUTS:
        root, _ = cgroup_tree(tmp_path / driver, driver, None)
        found = pod_cgroups(root)
        assert found.driver == driver
        assert [p.name for p in found.pods] == [Path(LAYOUTS[driver][1]).name]
    assert pod_cgroups(tmp_path / "nothing").driver == ""
