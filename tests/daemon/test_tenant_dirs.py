"""A tenant owns its cache directory and shares the lock directory: nothing it does there
costs another container, a card or the daemon.

The tenant's moves are made by this test process, root with every capability, like
root in a container with the runtime's default set (CAP_CHOWN, CAP_FOWNER,
CAP_DAC_OVERRIDE). Where capabilities matter, the daemon runs as the DaemonSet runs it:
a separate process, uid 0, with exactly the capabilities the manifest keeps (or none).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import yaml
from conftest import TESLA_P4, Node, cards
from kit.procs import daemon_command, free_port, poll, scrape

from gpushare.host.diskuse import MAX_DEPTH, measure
from gpushare.host.gc import GarbageCollector
from gpushare.host.library import (
    CACHE_LOCK,
    LOCK_DIR_NAME,
    cache_key,
    cache_root,
    ensure_lock_dir,
    prepare_cache_dir,
)
from gpushare.host.tombstones import Reaper, bury, tombstones
from gpushare.share.answers import CONTAINER_CACHE_DIR, LOCK_DIR
from gpushare.share.records import Snapshot
from gpushare.sim.kubeletdouble import Admitted

DAEMONSET = Path(__file__).resolve().parents[2] / "daemonset" / "daemonset.yaml"
STRANGER = 12345  # a uid that is neither the daemon's nor anyone's on the host
NOBODY = 65534
#: Deeper than Python's recursion limit; wide enough for several reaper steps. The issue's
#: 60 000 entries behave the same, only slower to build here (docs/security.md has figures).
DEEP = sys.getrecursionlimit() + 100
WIDE = 3000
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

can_drop_capabilities = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run the daemon with the DaemonSet's capabilities",
)


def manifest_capabilities() -> list[str]:
    """The capabilities the DaemonSet's container keeps (``add`` after ``drop: [ALL]``)."""
    (daemonset,) = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    capabilities = container["securityContext"]["capabilities"]
    assert capabilities["drop"] == ["ALL"]
    return [name.lower() for name in capabilities.get("add", [])]


def bounding(capabilities: list[str]) -> str:
    return ",".join(["-all", *(f"+{name}" for name in capabilities)])


@pytest.fixture
def started(node: Node) -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    try:
        yield processes
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)


def start_as_daemonset(
    node: Node,
    processes: list[subprocess.Popen[bytes]],
    capabilities: list[str],
    *,
    wrap: list[str] | None = None,
) -> Path:
    """The daemon as a separate process, root with only ``capabilities``; returns its log."""
    log_file = node.root / f"daemon-{len(processes)}.log"
    command = [
        "setpriv",
        f"--bounding-set={bounding(capabilities)}",
        *daemon_command(
            node, "--gc-grace-seconds", "1", "--pod-resources-interval-seconds", "1"
        ),
    ]
    with log_file.open("wb") as out:
        processes.append(
            subprocess.Popen([*(wrap or []), *command], stdout=out, stderr=subprocess.STDOUT)
        )
    return log_file


def cache_dir(admitted: Admitted) -> Path:
    return Path(admitted.mounts[CONTAINER_CACHE_DIR].host_path)


def buried(node: Node) -> list[str]:
    return tombstones(cache_root(Path(node.settings.host_lib_dir)))


def poison(directory: Path) -> None:
    """What a hostile root tenant can do to its directory without CAP_LINUX_IMMUTABLE."""
    (directory / "data").write_bytes(b"x" * 4096)
    plant = directory / "vgpu.cache"  # where the next tenant's interposer puts its file
    plant.mkdir()
    (plant / "inside").write_bytes(b"y")
    os.chown(plant / "inside", STRANGER, STRANGER)
    os.chmod(plant, 0o1000)  # sticky, no permission for anyone
    os.chown(plant, STRANGER, STRANGER)
    os.symlink("/etc", directory / "to-etc")
    os.mkfifo(directory / "fifo")
    setuid = directory / "door"
    setuid.write_bytes(b"#!/bin/sh\n")
    os.chmod(setuid, 0o4755)
    os.chmod(directory, 0)
    os.chown(directory, STRANGER, STRANGER)


def deep_tree(directory: Path, depth: int) -> None:
    """``depth`` nested directories, built relative to descriptors (no path limit)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as leaf:
            leaf.write(b"z")
    finally:
        os.close(fd)


def wide_tree(directory: Path, count: int) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for n in range(count):
            os.mkdir(f"s{n}", dir_fd=fd)
    finally:
        os.close(fd)


def count_entries(path: Path) -> int:
    """Entries below ``path`` (find walks deep trees without recursion limits)."""
    found = subprocess.run(
        ["find", str(path), "-mindepth", "1", "-printf", "x"], capture_output=True, check=True
    )
    return len(found.stdout)


@pytest.fixture
def deep_ok(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, emptied by this project's reaper afterwards: pytest's own clean-up
    recurses and would leave a tree deeper than the recursion limit behind."""
    try:
        yield tmp_path
    finally:
        reap(tmp_path)


def reap(path: Path) -> None:
    """Delete everything in ``path`` with the reaper (test clean-up of deep trees)."""
    with os.scandir(path) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        bury(path, name)
    Reaper(path).drain()


# -- 1, 4: poisoned units and plants, with the DaemonSet's own capabilities -------------


@can_drop_capabilities
def test_a_poisoned_directory_never_reaches_the_next_tenant_and_is_deleted(
    node: Node, started: list[subprocess.Popen[bytes]]
) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    node.kubelet.start()
    start_as_daemonset(node, started, manifest_capabilities())
    assert node.wait_registered(10.0)
    outside = node.root / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the daemon's to delete")
    first = node.kubelet.admit("a", "main", {node.memory: 2})
    os.symlink(outside, cache_dir(first) / "to-outside")
    poison(cache_dir(first))
    node.kubelet.release("a")
    second = node.kubelet.admit("b", "main", {node.memory: 2})  # the same units again
    assert second.devices == first.devices and cache_dir(second) == cache_dir(first)
    fresh = cache_dir(second)
    info = os.lstat(fresh)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
    assert stat.S_IMODE(info.st_mode) == 0o777 and list(fresh.iterdir()) == []
    # the reaper deletes what the first tenant left, through no link
    assert poll(lambda: buried(node) == [], 30.0)
    assert (outside / "keep").read_text() == "not the daemon's to delete"
    assert os.path.isdir("/etc") and started[0].poll() is None


@can_drop_capabilities
def test_without_any_capability_allocate_still_gets_a_fresh_directory(
    node: Node, started: list[subprocess.Popen[bytes]]
) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    node.kubelet.start()
    log_file = start_as_daemonset(node, started, [])
    assert node.wait_registered(10.0)
    first = node.kubelet.admit("a", "main", {node.memory: 2})
    poison(cache_dir(first))
    node.kubelet.release("a")
    for n in range(3):
        again = node.kubelet.admit(f"b{n}", "main", {node.memory: 2})
        assert again.devices == first.devices and list(cache_dir(again).iterdir()) == []
        os.chmod(cache_dir(again), 0)
        os.chown(cache_dir(again), STRANGER, STRANGER)
        node.kubelet.release(f"b{n}")
    # what it cannot delete stays buried where no one else can enter, and it says so
    assert poll(lambda: b"tombstone_stuck" in log_file.read_bytes(), 30.0)
    assert buried(node)
    info = os.lstat(cache_root(Path(node.settings.host_lib_dir)))
    assert info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o700
    other = node.kubelet.admit("c", "main", {node.memory: 5})
    assert cache_dir(other).is_dir() and started[0].poll() is None


# -- 2: deep trees ----------------------------------------------------------------------


def test_a_tree_deeper_than_the_recursion_limit_costs_nobody_anything(node: Node) -> None:
    try:
        daemon = node.start(
            cards(TESLA_P4, 1), gc_grace_seconds=0.3, pod_resources_interval_seconds=0.05
        )
        depth = DEEP
        first = node.kubelet.admit("a", "main", {node.memory: 2})
        other = node.kubelet.admit("z", "main", {node.memory: 3})  # released too, collected too
        deep_tree(cache_dir(first), depth)
        node.kubelet.release("a")
        again = node.kubelet.admit("b", "main", {node.memory: 2})
        assert again.devices == first.devices and list(cache_dir(again).iterdir()) == []
        deep_tree(cache_dir(again), depth)
        node.kubelet.release_all(["b", "z"])
        root = cache_root(Path(node.settings.host_lib_dir))
        assert poll(
            lambda: not any(p.name.startswith("c-") for p in root.iterdir()) and not buried(node),
            30.0,
        ), sorted(p.name for p in root.iterdir())
        assert not cache_dir(other).exists()
        assert daemon.core.refresher is not None and daemon.core.refresher._thread is not None
        assert daemon.core.refresher._thread.is_alive()
    finally:
        node.stop()  # then delete the deep trees the daemon may have left
        reap(node.root)


# -- per-allocation and GC work under the lock is O(1) ---------------------------------


def test_preparing_a_directory_again_leaves_the_old_tree_untouched_for_the_reaper(
    deep_ok: Path,
) -> None:
    tmp_path = deep_ok
    ids = ["GPU-x::0", "GPU-x::1"]
    path = prepare_cache_dir(tmp_path, ids)
    wide_tree(path, WIDE)
    again = prepare_cache_dir(tmp_path, ids)  # no reaper runs: nothing may be deleted yet
    assert again == path and list(again.iterdir()) == []
    (tombstone,) = tombstones(cache_root(tmp_path))
    # the Allocate did not touch one of them
    assert count_entries(cache_root(tmp_path) / tombstone) == WIDE
    reaper = Reaper(cache_root(tmp_path))
    with CACHE_LOCK:  # held as Allocate holds it: the reaper never needs it
        assert reaper.step()  # a bounded step: more remains after it
    other = prepare_cache_dir(tmp_path, ["GPU-x::5"])  # Allocate goes on between steps
    with CACHE_LOCK:
        reaper.drain()
    assert tombstones(cache_root(tmp_path)) == []
    assert other.is_dir() and again.is_dir()


def test_collection_buries_under_the_lock_and_deletes_outside_it(deep_ok: Path) -> None:
    tmp_path = deep_ok
    now = [0.0]
    collector = GarbageCollector(
        tmp_path, grace_seconds=10.0, current_library=None, clock=lambda: now[0]
    )
    path = prepare_cache_dir(tmp_path, ["GPU-x::0"])
    wide_tree(path, WIDE)
    deep_tree(path, DEEP)
    nobody = Snapshot(taken_at=0.0)
    now[0] = path.with_name(path.name + ".json").stat().st_mtime + 1
    assert collector.collect(nobody).records == []
    now[0] += 11.0
    assert collector.collect(nobody).records == [path.name]
    assert not path.exists() and not path.with_name(path.name + ".json").exists()
    (tombstone,) = tombstones(cache_root(tmp_path))
    # buried whole, not deleted in the pass
    assert count_entries(cache_root(tmp_path) / tombstone) == WIDE + DEEP + 1
    Reaper(cache_root(tmp_path)).drain()
    assert tombstones(cache_root(tmp_path)) == []


# -- 5: no door from the host into a tenant's directory ---------------------------------


def test_no_other_host_user_can_reach_a_tenants_directory(node: Node) -> None:
    host_lib = Path(node.settings.host_lib_dir)
    (host_lib / "containers").mkdir(parents=True)
    os.chmod(host_lib / "containers", 0o755)  # as an older version left it
    os.chmod(node.root, 0o755)  # the host's /usr/local is traversable
    node.start(cards(TESLA_P4, 1))
    admitted = node.kubelet.admit("a", "main", {node.memory: 2})
    door = cache_dir(admitted) / "door"
    door.write_bytes(b"#!/bin/sh\nid\n")
    os.chmod(door, 0o4755)
    lock = Path(admitted.mounts[LOCK_DIR].host_path)
    for path in (door, lock):
        reached = subprocess.run(
            [
                "setpriv",
                f"--reuid={NOBODY}",
                f"--regid={NOBODY}",
                "--clear-groups",
                "test",
                "-e",
                str(path),
            ],
            check=False,
        )
        assert reached.returncode == 1, f"{path} is reachable by uid {NOBODY}"
    info = os.lstat(host_lib / "containers")
    assert info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o700


# -- 6: size: measured with bounded work, reported ---------------------------------------


def test_an_oversized_cache_directory_is_measured_logged_and_exported(node: Node) -> None:
    port = free_port()
    daemon = node.start(
        cards(TESLA_P4, 1),
        gc_grace_seconds=0.2,
        pod_resources_interval_seconds=0.05,
        cache_dir_limit_mib=1,
        metrics_port=port,
        metrics_address="127.0.0.1",
    )
    admitted = node.kubelet.admit("big", "main", {node.memory: 2})
    with structlog.testing.capture_logs() as logs:
        with (cache_dir(admitted) / "fill").open("wb") as out:
            out.write(os.urandom(3 << 20))
            out.flush()
            os.fsync(out.fileno())
        assert daemon.core.collector is not None
        collector = daemon.core.collector
        assert poll(lambda: collector.sizes.over_limit == 1, 30.0)
    over = [e for e in logs if e["event"] == "cache_dir_over_limit"]
    assert len(over) == 1 and over[0]["holder"] == "default/big/main"
    # The measurement may land while the write is under way: over the limit, maybe not all.
    assert over[0]["bytes"] > 1 << 20 and over[0]["limit_bytes"] == 1 << 20

    def exported() -> bool:
        text = scrape(port)[1]
        (line,) = [x for x in text.splitlines() if x.startswith("gpushare_cache_dir_bytes ")]
        return "gpushare_cache_dirs_over_limit 1.0" in text and float(line.split()[1]) >= 3 << 20

    assert poll(exported, 30.0)


def test_measuring_never_follows_links_and_bounds_its_work(deep_ok: Path) -> None:
    tmp_path = deep_ok
    big = tmp_path / "big"
    big.write_bytes(os.urandom(1 << 20))
    tree = tmp_path / "tree"
    tree.mkdir()
    os.symlink(big, tree / "link")  # a link's size is its own, not its target's
    deep_tree(tree, MAX_DEPTH + 10)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deep = measure(fd, "tree")
        assert not deep.complete and deep.bytes < 1 << 20
        wide_tree(tree, 100)
        capped = measure(fd, "tree", max_entries=50)
        assert not capped.complete and capped.entries == 50
        assert measure(fd, "big").bytes >= 1 << 20
    finally:
        os.close(fd)


# -- 7: the lock directory --------------------------------------------------------------


@can_drop_capabilities
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a private /tmp")
def test_a_tenant_changing_the_lock_directory_never_stops_the_daemon(
    node: Node, started: list[subprocess.Popen[bytes]], request: pytest.FixtureRequest
) -> None:
    """Run without capabilities in a mount namespace of its own, whose /tmp/vgpulock (the
    old, shared location) a tenant chowned; the daemon's own lock directory is replaced
    by a link to somewhere else."""
    shared = node.root / "tmp-vgpulock"
    shared.mkdir()
    os.chown(shared, STRANGER, STRANGER)
    os.chmod(shared, 0o700)
    root = cache_root(Path(node.settings.host_lib_dir))
    root.mkdir(parents=True)
    elsewhere = node.root / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    os.chmod(elsewhere, 0o755)
    os.symlink(elsewhere, root / LOCK_DIR_NAME)
    node.write_gpus(cards(TESLA_P4, 1))
    node.kubelet.start()
    # A fresh machine has no /tmp/vgpulock to mount onto: the test makes its own mount point
    # (an empty directory, removed again at the end) rather than relying on an earlier run.
    made_mount_point = not os.path.lexists(LOCK_DIR)
    if made_mount_point:
        os.mkdir(LOCK_DIR, 0o755)
        request.addfinalizer(lambda: os.rmdir(LOCK_DIR))
    command = f'mount --bind "{shared}" {LOCK_DIR} && exec "$@"'
    start_as_daemonset(node, started, [], wrap=["unshare", "--mount", "sh", "-c", command, "-"])
    assert node.wait_registered(10.0), "the daemon did not start"
    admitted = node.kubelet.admit("a", "main", {node.memory: 2})
    lock = Path(admitted.mounts[LOCK_DIR].host_path)
    assert lock == root / LOCK_DIR_NAME
    info = os.lstat(lock)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == 0
    assert stat.S_IMODE(info.st_mode) == 0o1777
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755  # the link was not followed
    # a tenant chowns it while the daemon runs: the next GC pass makes it usable again
    # (without CAP_FOWNER by replacing it; with the DaemonSet's capabilities in place:
    # test_the_lock_directory_is_repaired_in_place_by_the_daemon)
    os.chown(lock, STRANGER, STRANGER)
    os.chmod(lock, 0o700)
    assert poll(lambda: stat.S_IMODE(os.lstat(lock).st_mode) == 0o1777, 30.0)
    assert started[0].poll() is None


@can_drop_capabilities
def test_the_lock_directory_is_repaired_in_place_by_the_daemon(
    node: Node, started: list[subprocess.Popen[bytes]]
) -> None:
    """The daemon run as the DaemonSet runs it (only CAP_DAC_OVERRIDE
    and CAP_FOWNER): a tenant's chown and chmod of the shared lock directory are undone
    in place; the container that mounted it keeps a directory it can create files in."""
    node.write_gpus(cards(TESLA_P4, 1))
    node.kubelet.start()
    log = start_as_daemonset(node, started, manifest_capabilities())
    assert node.wait_registered(10.0), "the daemon did not start"
    admitted = node.kubelet.admit("a", "main", {node.memory: 2})
    lock = Path(admitted.mounts[LOCK_DIR].host_path)
    mounted = os.open(lock, os.O_RDONLY | os.O_DIRECTORY)  # what the container holds
    try:
        os.chown(lock, STRANGER, STRANGER)
        os.chmod(lock, 0o700)
        assert poll(lambda: stat.S_IMODE(os.lstat(lock).st_mode) == 0o1777, 30.0)
        assert os.lstat(lock).st_ino == os.fstat(mounted).st_ino
        assert poll(lambda: "lock_dir_repaired" in log.read_text(), 30.0)
        # a reaper pass later, the container still creates HAMi-core's lock file
        assert poll(lambda: not buried(node), 30.0)
        made = os.open("vgpu.lock", os.O_CREAT | os.O_WRONLY, 0o666, dir_fd=mounted)
        os.close(made)
    finally:
        os.close(mounted)
    assert started[0].poll() is None


def test_the_lock_directory_is_repaired_whatever_stands_in_its_place(tmp_path: Path) -> None:
    root = cache_root(tmp_path)
    path = ensure_lock_dir(tmp_path)
    assert path == root / LOCK_DIR_NAME
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chmod(elsewhere, 0o700)
    replacements = [
        lambda: os.chmod(path, 0o777),
        lambda: os.chown(path, STRANGER, STRANGER),
        lambda: (os.rmdir(path), path.write_text("a file")),
        lambda: (os.rmdir(path), os.symlink(elsewhere, path)),
        lambda: os.rmdir(path),
    ]
    for replace in replacements:
        replace()
        assert ensure_lock_dir(tmp_path) == path
        info = os.lstat(path)
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
        assert stat.S_IMODE(info.st_mode) == 0o1777
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o700
    Reaper(root).drain()
    assert tombstones(root) == []
    assert elsewhere.is_dir()


def test_repairing_the_lock_directory_never_takes_it_from_running_containers(
    tmp_path: Path,
) -> None:
    """A tenant's chown made the GC pass bury the directory and the
    reaper delete it, leaving every running container an unlinked directory in which
    HAMi-core could create no lock file. A running container is played by a descriptor
    of the directory it mounted (a bind mount holds the inode the same way)."""
    root = cache_root(tmp_path)
    path = ensure_lock_dir(tmp_path)
    mounted = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for change in (
            lambda: (os.chown(path, STRANGER, STRANGER), os.chmod(path, 0o700)),
            lambda: os.chmod(path, 0o000),
            lambda: os.chmod(path, 0o2755),
        ):
            change()
            assert ensure_lock_dir(tmp_path) == path
            Reaper(root).drain()
            info = os.lstat(path)
            assert info.st_ino == os.fstat(mounted).st_ino  # the same directory, in place
            assert stat.S_IMODE(info.st_mode) == 0o1777 and info.st_uid == os.geteuid()
            lock = os.open("vgpu.lock", os.O_CREAT | os.O_WRONLY, 0o666, dir_fd=mounted)
            os.close(lock)
            os.unlink("vgpu.lock", dir_fd=mounted)
    finally:
        os.close(mounted)


def test_cache_keys_are_not_affected_by_tombstones(tmp_path: Path) -> None:
    path = prepare_cache_dir(tmp_path, ["GPU-x::0"])
    assert path.name == cache_key(["GPU-x::0"])
    prepare_cache_dir(tmp_path, ["GPU-x::0"])
    names = {p.name for p in cache_root(tmp_path).iterdir()} - set(tombstones(cache_root(tmp_path)))
    assert names == {path.name, f"{path.name}.json"}
