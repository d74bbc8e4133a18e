"""Garbage collection of cache directories and old interposer versions."""

from __future__ import annotations

import json
import time
from pathlib import Path

from conftest import TESLA_P4, Node, cards
from kit.procs import poll

from gpushare.daemon import Daemon
from gpushare.host.elf import stand_in
from gpushare.host.gc import GarbageCollector
from gpushare.host.library import prepare_cache_dir
from gpushare.share.answers import CONTAINER_CACHE_DIR, CONTAINER_LIBRARY
from gpushare.share.records import Snapshot
from gpushare.sim.kubeletdouble import Admitted

GRACE = 0.3


def cache_dir(admitted: Admitted) -> Path:
    return Path(admitted.mounts[CONTAINER_CACHE_DIR].host_path)


def library_of(admitted: Admitted) -> Path:
    return Path(admitted.mounts[CONTAINER_LIBRARY].host_path)


def reads_after(daemon: Daemon, count: int, timeout: float = 30.0) -> bool:
    """Wait for ``count`` more successful PodResources reads (each may collect)."""
    assert daemon.core.refresher is not None
    refresher = daemon.core.refresher
    target = refresher.reads + count
    return poll(lambda: refresher.reads >= target, timeout)


def test_released_cache_dirs_go_after_the_grace_period_held_ones_stay(node: Node) -> None:
    daemon = node.start(
        cards(TESLA_P4, 1), gc_grace_seconds=GRACE, pod_resources_interval_seconds=0.05
    )
    a = node.kubelet.admit("a", "main", {node.memory: 2})
    b = node.kubelet.admit("b", "main", {node.memory: 3, node.core: 10})
    assert cache_dir(a).is_dir() and cache_dir(b).is_dir()
    # Let a collection see both held: one that ran between Allocate and the kubelet's
    # record of it would otherwise start a's grace period before its release.
    assert reads_after(daemon, 4)
    node.kubelet.release("a")
    released = time.monotonic()
    assert poll(
        lambda: not cache_dir(a).exists() and not cache_dir(a).with_suffix(".json").exists(),
        30.0,
    )
    assert time.monotonic() - released >= GRACE
    assert reads_after(daemon, 3)
    assert cache_dir(b).is_dir()  # still held: never removed, however long
    assert cache_dir(b).with_name(cache_dir(b).name + ".json").exists()


def test_an_unreadable_kubelet_collects_nothing(node: Node) -> None:
    daemon = node.start(
        cards(TESLA_P4, 1), gc_grace_seconds=GRACE, pod_resources_interval_seconds=0.05
    )
    a = node.kubelet.admit("a", "main", {node.memory: 2})
    assert daemon.core.refresher is not None
    refresher = daemon.core.refresher
    node.kubelet.stop()  # PodResources gone with it: no evidence, no removal
    failures = refresher.failures
    assert poll(lambda: refresher.failures >= failures + 3, 30.0)
    assert cache_dir(a).is_dir()


def test_an_old_library_goes_once_no_container_from_its_time_remains(node: Node) -> None:
    daemon = node.start(
        cards(TESLA_P4, 1), gc_grace_seconds=GRACE, pod_resources_interval_seconds=0.05
    )
    old = node.kubelet.admit("old", "main", {node.memory: 2})
    old_library = library_of(old)
    daemon.stop()
    node.library.write_bytes(stand_in(b"a newer interposer\n"))  # an upgrade
    node.daemon = daemon = Daemon(node.settings)
    daemon.start()
    assert node.kubelet.wait_for(
        lambda k: len(k.registrations) >= 4
        and k.healthy_count(node.memory) == 29
        and k.healthy_count(node.core) == 100,  # both lists, before asking for both
        5.0,
    )
    new = node.kubelet.admit("new", "main", {node.memory: 2, node.core: 5})
    new_library = library_of(new)
    assert new_library != old_library
    preload_old = old_library.with_name("ld.so.preload." + old_library.name.rsplit(".", 1)[1])
    preload_old.write_text("/usr/local/vgpu/libvgpu.so\n")  # from an earlier preload=file
    assert reads_after(daemon, 3)
    assert poll(lambda: (Path(node.settings.host_lib_dir) / "libraries.json").exists(), 30.0)
    started = time.monotonic()
    assert poll(lambda: time.monotonic() - started > GRACE and reads_after(daemon, 2), 30.0)
    assert old_library.exists()  # the container allocated with it still runs
    node.kubelet.release("old")
    assert poll(lambda: not old_library.exists() and not preload_old.exists(), 30.0)
    assert new_library.exists()
    assert node.library.exists()


def test_a_directory_prepared_again_while_unheld_gets_a_full_grace_period(
    tmp_path: Path,
) -> None:
    ids = ["GPU-x::0", "GPU-x::1"]
    now = [time.time() + 1.0]
    collector = GarbageCollector(
        tmp_path, grace_seconds=10.0, current_library=None, clock=lambda: now[0]
    )
    nobody = Snapshot(taken_at=0.0)
    path = prepare_cache_dir(tmp_path, ids)
    missed = now[0]
    assert collector.collect(nobody).records == []  # missing from here on
    now[0] += 5.0
    prepare_cache_dir(tmp_path, ids)  # a new container got the same units, and left
    record = path.with_name(path.name + ".json")
    record.write_text(json.dumps({**json.loads(record.read_text()), "created": now[0]}))
    again = now[0]
    now[0] = missed + 10.5  # the first preparation's grace is over, not the second's
    assert collector.collect(nobody).records == [] and path.is_dir()
    now[0] = again + 9.5
    assert collector.collect(nobody).records == [] and path.is_dir()
    now[0] = again + 10.5
    assert collector.collect(nobody).records == [path.name] and not path.exists()
