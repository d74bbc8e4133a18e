"""A node reboot empties the daemon's CDI directory (the grants' own specs under ``cdi-*``)
and the cache tmpfs (each memory grant's cache directory); the kubelet keeps its Allocate
answers in its checkpoint and reuses them for the containers it starts again, asking the
plugin nothing. So the daemon makes again, from what PodResources lists (pod, container,
resource, device IDs), every grant's spec and directory, the same as the Allocate made
them: the CDI name the answer holds resolves again, the mount's source is there.

Real gRPC, the kubelet stand-in: a "reboot" is the daemon stopped, the kubelet restarted
(its allocations kept, as its checkpoint keeps them), the CDI directory and the cache root
emptied like a fresh tmpfs, the daemon started again."""

from __future__ import annotations

import itertools
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import TESLA_P4, Node, cards
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit.cdi_runtime import final
from kit.mig_layouts import reference_a100
from kit.procs import poll
from structlog.testing import capture_logs

from gpushare.daemon import Daemon
from gpushare.host.library import cache_key, cache_root

#: the kubelet's records read every 50 ms (a read is what makes a listed grant again)
#: (the nodes below have one shared card, card 1 whole only: a pairing guess, made without
#: pod specs, can never refuse a container here)
FAST_READS = {"pod_resources_interval_seconds": 0.05}


def own(node: Node) -> Path:
    return Path(node.settings.dra_cdi_dir)


def grant_specs(node: Node) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in own(node).glob("*-grant_*.json")}


def cache_dirs(node: Node) -> list[str]:
    root = cache_root(Path(node.settings.host_lib_dir))
    return sorted(p.name for p in root.iterdir() if p.name.startswith("c-") and p.is_dir())


def names(admitted: Any) -> list[str]:
    found: list[str] = []
    for response in admitted.responses.values():
        found += [d.name for d in response.cdi_devices]
        for key, value in response.annotations.items():
            if key.startswith("cdi.k8s.io/"):
                found += value.split(",")
    return [n for n in dict.fromkeys(found) if not n.startswith("nvidia.com/")]


def runtime(node: Node, admitted: Any) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The env and mounts the runtime gives the container from the kubelet's answer (as
    its checkpoint keeps it) and the daemon's CDI specs now; KeyError if a name does not
    resolve (the container's creation fails)."""
    return final(
        list(admitted.envs.items()),
        [(path, m.host_path) for path, m in admitted.mounts.items()],
        names(admitted),
        [own(node)],
    )


def empty_tmpfs(node: Node) -> None:
    """The daemon's CDI directory and cache root emptied, as a reboot leaves them. A running
    daemon may write there meanwhile (a temporary file renamed away under the listing):
    what vanished is gone already."""
    if own(node).exists():
        for path in own(node).iterdir():
            path.unlink(missing_ok=True)
    root = cache_root(Path(node.settings.host_lib_dir))
    for path in root.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def reboot(node: Node, *, listed_later: bool = False, resource: str | None = None) -> None:
    assert node.daemon is not None
    node.daemon.stop()
    node.kubelet.restart(empty_pod_manager=listed_later)
    empty_tmpfs(node)
    node.daemon = Daemon(node.settings, specs=node.specs)
    node.daemon.start()
    if resource is None:
        assert node.wait_registered()
    else:
        assert node.kubelet.wait_for(lambda k: bool(k.devices(resource)))


def reads_after(node: Node, count: int) -> bool:
    assert node.daemon is not None and node.daemon.core.refresher is not None
    refresher = node.daemon.core.refresher
    target = refresher.reads + count
    return poll(lambda: refresher.reads >= target, 30.0)


@pytest.mark.parametrize("strategy", ["cdi-cri", "cdi-annotations", "envvar,cdi-cri"])
def test_a_reboot_gives_every_grant_its_spec_and_cache_directory_back(
    node: Node, strategy: str
) -> None:
    gpu = f"{node.settings.resource_prefix}/gpu"
    node.start(
        cards(TESLA_P4, 2),
        device_list_strategy=strategy,
        whole_cards=True,
        card_modes="0=shared,1=exclusive",
    )
    assert node.kubelet.wait_for(lambda k: bool(k.devices(gpu)))
    pods = [
        node.kubelet.admit("both", "main", {node.memory: 4, node.core: 30}),
        node.kubelet.admit("memory", "main", {node.memory: 9}),
        node.kubelet.admit("whole", "main", {gpu: 1}),
    ]
    before = [runtime(node, p) for p in pods]
    specs, dirs = grant_specs(node), cache_dirs(node)
    assert len(specs) == 4 and len(dirs) == 2
    with capture_logs() as logs:
        reboot(node)
    assert grant_specs(node) == specs  # byte for byte, before the plugin registered
    assert cache_dirs(node) == dirs
    root = cache_root(Path(node.settings.host_lib_dir))
    for name in dirs:
        assert oct((root / name).stat().st_mode & 0o777) == "0o777"
    assert [runtime(node, p) for p in pods] == before  # the kubelet's answers resolve again
    rebuilt = [e for e in logs if e["event"] == "grant_rebuilt"]
    assert len(rebuilt) == 4
    assert {e["pod"] for e in rebuilt} == {"default/both", "default/memory", "default/whole"}


@pytest.mark.parametrize("kind", ["mig", "time-sliced"])
def test_mig_devices_and_replicas_get_their_specs_back(node: Node, kind: str) -> None:
    prefix = node.settings.resource_prefix
    if kind == "mig":
        resource, gpus = f"{prefix}/mig-3g.20gb", [reference_a100()]
        overrides: dict[str, Any] = {"mig_strategy": "mixed"}
    else:
        resource, gpus = f"{prefix}/gpu.shared", cards(TESLA_P4, 2)
        overrides = {"card_modes": "0=timeslice", "time_slice_replicas": "2"}
    node.write_gpus(gpus)
    node.settings = replace(node.settings, device_list_strategy="cdi-cri", **overrides)
    node.kubelet.start()
    node.daemon = Daemon(node.settings, specs=node.specs)
    node.daemon.start()
    assert node.kubelet.wait_for(lambda k: bool(k.devices(resource)))
    admitted = node.kubelet.admit("x", "main", {resource: 1})
    before, specs = runtime(node, admitted), grant_specs(node)
    assert len(specs) == 1
    reboot(node, resource=resource)
    assert grant_specs(node) == specs
    assert runtime(node, admitted) == before


def test_holdings_the_kubelet_lists_later_get_theirs_back_at_that_read(node: Node) -> None:
    """A restarted kubelet lists its pods as it admits them again, after the plugin
    registered: each read that lists a holding whose spec is gone makes it again."""
    node.start(cards(TESLA_P4, 1), device_list_strategy="cdi-cri", **FAST_READS)
    admitted = node.kubelet.admit("late", "main", {node.memory: 2, node.core: 10})
    before, specs = runtime(node, admitted), grant_specs(node)
    reboot(node, listed_later=True)
    assert grant_specs(node) == {}  # nobody listed yet: nothing to make
    node.kubelet.pods_synced()
    assert reads_after(node, 2)
    assert poll(lambda: grant_specs(node) == specs, 30.0)
    assert runtime(node, admitted) == before


def test_envvar_cache_directories_come_back_and_a_runtimes_one_is_repaired_in_place(
    node: Node,
) -> None:
    node.start(cards(TESLA_P4, 1))
    first = node.kubelet.admit("a", "main", {node.memory: 3})
    second = node.kubelet.admit("b", "main", {node.memory: 5})
    assert not own(node).exists() or grant_specs(node) == {}
    keys = [cache_key(first.devices[node.memory]), cache_key(second.devices[node.memory])]
    assert cache_dirs(node) == sorted(keys)
    assert node.daemon is not None
    node.daemon.stop()
    node.kubelet.restart()
    empty_tmpfs(node)
    # containerd started "b" before the daemon: it made the missing mount source itself
    root = cache_root(Path(node.settings.host_lib_dir))
    made = root / keys[1]
    os.mkdir(made, 0o755)
    inode = made.stat().st_ino
    node.daemon = Daemon(node.settings, specs=node.specs)
    node.daemon.start()
    assert cache_dirs(node) == sorted(keys)
    assert made.stat().st_ino == inode  # the one the container has mounted, kept
    assert all(oct((root / k).stat().st_mode & 0o777) == "0o777" for k in keys)
    mounts = dict(runtime(node, second)[1])
    assert Path(mounts["/usr/local/vgpu/cache"]) == made


def test_a_spec_or_directory_still_there_is_left_as_it_is(node: Node) -> None:
    node.start(cards(TESLA_P4, 1), device_list_strategy="cdi-cri", **FAST_READS)
    node.kubelet.admit("a", "main", {node.memory: 3})
    (spec,) = own(node).glob("*-grant_*.json")
    (key,) = cache_dirs(node)
    written = cache_root(Path(node.settings.host_lib_dir)) / key / "vgpu.cache"
    written.write_bytes(b"the tenant's accounting")
    mtime = spec.stat().st_mtime_ns
    with capture_logs() as logs:
        assert reads_after(node, 2)
    assert not [e for e in logs if e["event"] == "grant_rebuilt"]
    assert spec.stat().st_mtime_ns == mtime and written.read_bytes() == b"the tenant's accounting"


NAMES = itertools.count()


@pytest.fixture
def cdi_node(node: Node) -> Node:
    gpu = f"{node.settings.resource_prefix}/gpu"
    node.start(
        cards(TESLA_P4, 2),
        device_list_strategy="cdi-cri",
        whole_cards=True,
        card_modes="0=shared,1=exclusive",
        **FAST_READS,
    )
    assert node.kubelet.wait_for(lambda k: bool(k.devices(gpu)))
    return node


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    memory=st.integers(min_value=1, max_value=29),
    cores=st.one_of(st.none(), st.integers(min_value=1, max_value=100)),
    whole=st.booleans(),
)
def test_a_rebuilt_grant_spec_is_the_one_first_written(
    cdi_node: Node, memory: int, cores: int | None, whole: bool
) -> None:
    """For any grant (a share of memory, of cores, a whole card), what the restore writes
    is byte for byte what its Allocate wrote, and the container's env and mounts from the
    kubelet's kept answer are the same."""
    node = cdi_node
    gpu = f"{node.settings.resource_prefix}/gpu"
    asked = {gpu: 1} if whole else {node.memory: memory, **({node.core: cores} if cores else {})}
    pod = f"p{next(NAMES)}"
    admitted = node.kubelet.admit(pod, "main", asked)
    files = [f"{n.replace('/grant=', '-grant_')}.json" for n in names(admitted)]
    before = runtime(node, admitted)
    specs = {f: (own(node) / f).read_bytes() for f in files}
    empty_tmpfs(node)  # and the specs of pods released before, kept for the grace period
    assert reads_after(node, 2)
    assert poll(lambda: all((own(node) / f).exists() for f in files), 30.0)
    assert {f: (own(node) / f).read_bytes() for f in files} == specs
    assert runtime(node, admitted) == before
    node.kubelet.release(pod)
