"""A host cleanup applied to a node laid out in a temporary directory (``host/sweep.py``):
everything of gpushare goes (a tenant's hostile cache directory through no link), what a
running container holds stays, names of others are never touched. The tmpfs mounts are
the e2e's (tests/e2e/test_uninstall_real.py): mounting needs a real node."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpushare.host.leftovers import Held
from gpushare.host.sweep import Dirs, Outcome, clean, names_in, our_mounts, summary
from gpushare.host.sweepplan import Naming

A = "a" * 12
KEY1, KEY2 = "1" * 20, "2" * 20
GRANT = f"vcuda-memory-{'3' * 20}"
UID = "0b1e0c1a-0000-4000-8000-000000000001"
NAMING = Naming("gpushare.io", "gpu.gpushare.io")


def node(root: Path) -> Dirs:
    """A node as an uninstalled daemon leaves it: everything it writes, a tenant's
    hostile cache directory, and names of others in every place."""
    host = root / "vgpu"
    (root / "outside").mkdir()
    (root / "outside" / "precious").write_text("not gpushare's")
    for key in (KEY1, KEY2):
        cache = host / "containers" / f"c-{key}"
        (cache / "deep" / "deeper").mkdir(parents=True)
        (cache / "deep" / "deeper" / "file").write_bytes(b"x" * 64)
        (host / "containers" / f"c-{key}.json").write_text("{}")
    hostile = host / "containers" / f"c-{KEY2}"
    (hostile / "link").symlink_to(root / "outside")  # a link out of the cache directory
    (hostile / "locked").mkdir(mode=0o000)  # chmod 000
    os.chmod(hostile / "deep", 0o1777)  # sticky
    (host / "containers" / f"d-{KEY2}").mkdir()
    (host / "containers" / "vgpulock").mkdir(mode=0o1777)
    for name in (f"libvgpu.so.{A}", f"ld.so.preload.{A}", f"gpushare-memory-hook.{A}"):
        (host / name).write_bytes(b"\x7fELF")
    (host / "memory-unit.json").write_text("{}")
    for sub in ("mps/pipe/ns-1", "mps/log", "mps/shm", f"claimholders/d-{KEY2}", "dra"):
        (host / sub).mkdir(parents=True)
    (host / "mps" / "pipe" / "control").write_text("")
    (host / "mps" / "log" / "control.log").write_text("started\n")
    (host / "mps" / "shm" / "cuda.shm.1").write_bytes(b"\0" * 16)
    (host / "claimholders" / f"d-{KEY2}" / "holder").write_text("/k8s.io/x")
    (host / "dra" / f"{UID}.json").write_text("{}")
    plugins = root / "kubelet" / "device-plugins"
    plugins.mkdir(parents=True)
    for name in ("kubelet.sock", "gpushare-vcuda-memory.sock", "gpushare-vcuda-core.0a-1.sock"):
        (plugins / name).write_text("")
    (plugins / "nvidia-gpu.sock").symlink_to(root / "outside" / "precious")
    registry = root / "kubelet" / "plugins_registry"
    registry.mkdir()
    (registry / "gpu.gpushare.io-reg.sock").write_text("")
    (registry / "other.example-reg.sock").write_text("")
    (root / "kubelet" / "plugins" / "gpu.gpushare.io").mkdir(parents=True)
    (root / "kubelet" / "plugins" / "gpu.gpushare.io" / "dra.sock").write_text("")
    cdi = root / "cdi"
    cdi.mkdir()
    (cdi / f"gpushare.io-grant_{GRANT}.json").write_text("{}")
    (cdi / f"gpu.gpushare.io-claim_{UID}.json").write_text("{}")
    (cdi / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    return Dirs(host, plugins, root / "kubelet", "gpu.gpushare.io", (cdi,))


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.skipif(os.geteuid() != 0, reason="a tenant's chmod 000 directory: root's to remove")
def test_with_nothing_held_nothing_of_gpushare_is_left(tmp_path: Path) -> None:
    dirs = node(tmp_path)
    outcome = clean(dirs, NAMING, Held(claim_uids=frozenset()))
    assert outcome.failed == {} and outcome.kept == {}
    assert outcome.host_dir_removed and not dirs.host_dir.exists()
    assert tree(tmp_path) == {
        "outside",
        "outside/precious",  # the link into it was removed, never followed
        "kubelet",
        "kubelet/device-plugins",
        "kubelet/device-plugins/kubelet.sock",
        "kubelet/device-plugins/nvidia-gpu.sock",
        "kubelet/plugins_registry",
        "kubelet/plugins_registry/other.example-reg.sock",
        "kubelet/plugins",
        "cdi",
        "cdi/nvidia.yaml",
    }
    assert (tmp_path / "outside" / "precious").read_text() == "not gpushare's"
    assert outcome.unmounted == []  # no tmpfs here
    # a second run finds nothing to do
    again = clean(dirs, NAMING, Held(claim_uids=frozenset()))
    assert again.removed == [] and again.failed == {} and again.kept == {}


def test_a_running_container_and_a_claim_in_use_keep_what_they_hold(tmp_path: Path) -> None:
    dirs = node(tmp_path)
    held = Held(
        cache_keys=frozenset({f"c-{KEY1}"}),
        holders=frozenset({"ns/p/c/d"}),
        claims=True,
        grants=frozenset({GRANT}),
        claim_uids=frozenset({UID}),
    )
    outcome = clean(dirs, NAMING, held)
    host = dirs.host_dir
    left = tree(host)
    assert f"containers/c-{KEY1}/deep/deeper/file" in left and f"containers/c-{KEY1}.json" in left
    assert f"containers/c-{KEY2}" not in left and f"containers/c-{KEY2}.json" not in left
    assert {"mps/shm/cuda.shm.1", f"claimholders/d-{KEY2}/holder", f"dra/{UID}.json"} <= left
    assert {f"libvgpu.so.{A}", "memory-unit.json", f"containers/d-{KEY2}"} <= left
    assert names_in(tmp_path / "cdi") == {
        f"gpushare.io-grant_{GRANT}.json",
        f"gpu.gpushare.io-claim_{UID}.json",
        "nvidia.yaml",
    }
    assert not (tmp_path / "kubelet" / "plugins" / "gpu.gpushare.io").exists()
    assert f"{host}/containers/c-{KEY1}" in outcome.kept and not outcome.host_dir_removed
    assert f"{tmp_path}/cdi/gpu.gpushare.io-claim_{UID}.json" in outcome.kept
    # the run after the container and the claim ended finishes the job
    done = clean(dirs, NAMING, Held(claim_uids=frozenset()))
    assert (
        done.kept == {} and done.host_dir_removed and names_in(tmp_path / "cdi") == {"nvidia.yaml"}
    )


def test_a_host_directory_holding_a_name_not_ours_stays_with_that_name(tmp_path: Path) -> None:
    dirs = node(tmp_path)
    (dirs.host_dir / "test").mkdir()
    (dirs.host_dir / "test" / "node.yaml").write_text("gpus: []\n")
    outcome = clean(dirs, NAMING, Held(claim_uids=frozenset()))
    assert tree(dirs.host_dir) == {"test", "test/node.yaml"} and not outcome.host_dir_removed


def test_only_our_tmpfs_counts_as_ours(tmp_path: Path) -> None:
    assert our_mounts(tmp_path) == frozenset()  # a plain directory: nothing mounted there


def test_the_report_fits_a_termination_message() -> None:
    outcome = Outcome(
        removed=["x"] * 5000,
        kept={
            f"/usr/local/vgpu/containers/c-{i:020d}": "its container is running" for i in range(500)
        },
    )
    report = summary(outcome, 4000)
    assert len(json.dumps(report)) <= 4000
    assert report["removed"] == 5000 and report["kept_not_shown"] == 500 - len(report["kept"])  # type: ignore[arg-type]


def test_the_host_directory_is_removed_through_its_parent_mount(tmp_path: Path) -> None:
    dirs = node(tmp_path)
    (dirs.host_dir / "mps" / "shm" / "cuda.shm.1").unlink()
    apart = Dirs(
        dirs.host_dir, dirs.device_plugins, dirs.kubelet_root, dirs.driver, dirs.cdi, tmp_path
    )
    outcome = clean(apart, NAMING, Held(claim_uids=frozenset()))
    assert outcome.host_dir_removed and not dirs.host_dir.exists()
