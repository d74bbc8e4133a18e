"""The /dev/shm MPS servers and every client on an ``mps`` card share is bounded,
measured, and swept of segments nobody holds (issue 41 item 2).

Before: ``<host-lib-dir>/mps/shm`` was a plain host directory, read-write in every
client; 48 MiB written under the chart's 8 MiB cache bound, all still there after the
pod and both daemons had gone. The bound runs here as the init container runs it, as
root in a private mount namespace of its own (``unshare``)."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_tenant_writes_bounded import needs_mounts

from gpushare.host.mps import mps_shm_dir
from gpushare.host.mpsshm import MpsShm, MpsShmMetrics, clients_live, held_inodes
from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder

#: Played inside the namespace: the init container's command, then a tenant writing
#: 48 MiB into /dev/shm as an MPS client can.
SCENARIO = r"""
import errno, json, os, sys
from pathlib import Path
from gpushare.host import cachefs
from gpushare.host.mps import mps_shm_dir

host = Path(sys.argv[1])
rc = cachefs.main(["--host-lib-dir", str(host), "--size-mib", "8", "--mps-shm-size-mib", "8"])
shm = mps_shm_dir(host)
total, error = 0, None
try:
    with open(shm / "cuda.shm.4242.1", "wb") as out:
        while total < 48 << 20:
            out.write(b"x" * (1 << 20))
            out.flush()
            total += 1 << 20
except OSError as exc:
    error = errno.errorcode.get(exc.errno, str(exc.errno))
bound = cachefs.bound_of(shm)
print(json.dumps({"rc": rc, "own": bound.own, "type": bound.fs_type, "size": bound.size_bytes,
                  "mode": oct(os.stat(shm).st_mode & 0o7777),
                  "written": os.stat(shm / "cuda.shm.4242.1").st_blocks * 512, "error": error}))
"""


@needs_mounts
def test_a_client_cannot_write_past_the_shm_bound(tmp_path: Path) -> None:
    host = tmp_path / "vgpu"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", SCENARIO,
         str(host)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["rc"] == 0
    assert found["own"] and found["type"] == "tmpfs" and found["size"] == 8 << 20
    assert found["mode"] == "0o1777"  # every client writes segments there
    assert found["error"] == "ENOSPC" and found["written"] <= 8 << 20
    assert list(mps_shm_dir(host).iterdir()) == []  # nothing reached the host's disk


def _segment(shm: Path, name: str, size: int, age: float = 3600.0) -> Path:
    path = shm / name
    path.write_bytes(b"s" * size)
    old = path.stat().st_mtime - age
    os.utime(path, (old, old))
    return path


def test_segments_nobody_holds_go_once_no_client_lives(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    left = [_segment(shm, f"cuda.shm.{pid}.1", 1 << 20) for pid in (11, 12, 13)]
    young = _segment(shm, "cuda.shm.14.1", 4096, age=0.0)
    held = _segment(shm, "cuda.shm.15.1", 1 << 20)  # the server's: mapped by a process
    (shm / "planted").symlink_to("/etc/passwd")
    old = young.stat().st_mtime - 3600
    os.utime(shm / "planted", (old, old), follow_symlinks=False)
    # the processes the daemon sees: here this one (the MPS server's stand-in), as a
    # daemon's pod sees itself and the MPS daemons it runs
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / str(os.getpid())).symlink_to(f"/proc/{os.getpid()}")
    keeper = MpsShm(shm, limit_bytes=2 << 20, proc_root=proc)
    with held.open("r+b") as handle, mmap.mmap(handle.fileno(), 0) as mapped:
        assert held.stat().st_ino in (held_inodes(shm.stat().st_dev, proc) or set())
        # a client lives: nothing is removed, the directory is measured and logged
        assert keeper.pass_(clients_live=True, now=held.stat().st_mtime + 7200) == []
        assert keeper.state.usage.bytes >= 4 << 20 and keeper.state.over_limit
        removed = keeper.pass_(clients_live=False, now=young.stat().st_mtime + 1)
        assert mapped[0:1] == b"s"
    assert sorted(removed) == sorted([p.name for p in left] + ["planted"])
    assert sorted(p.name for p in shm.iterdir()) == [young.name, held.name]
    assert Path("/etc/passwd").exists()  # the link was unlinked, never followed
    assert keeper.state.removed_total == 4 and not keeper.state.over_limit
    families = {f.name: f.samples[0].value for f in MpsShmMetrics(keeper).collect()}
    assert families["gpushare_mps_shm_bytes"] == keeper.state.usage.bytes
    assert families["gpushare_mps_shm_segments_removed"] == 4


def test_a_process_that_cannot_be_read_keeps_every_segment(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "77").mkdir(parents=True)
    (proc / "77" / "maps").mkdir()  # not readable as a file: that process is unknown
    shm = tmp_path / "shm"
    shm.mkdir()
    segment = _segment(shm, "cuda.shm.77.1", 4096)
    keeper = MpsShm(shm, limit_bytes=1 << 20, proc_root=proc)
    assert keeper.pass_(clients_live=False, now=segment.stat().st_mtime + 7200) == []
    assert segment.exists()


@pytest.mark.parametrize(
    ("snapshot", "namespaces", "claims", "live"),
    [
        (Snapshot(0.0), 0, None, False),
        (Snapshot(0.0), 1, None, True),  # a capped namespace: a client
        (Snapshot(0.0), 0, {"GPU-M": ["claim"]}, True),  # a claim on the mps card
        (Snapshot(0.0), 0, {"GPU-O": ["claim"]}, False),  # on another card
        (
            Snapshot(0.0, holders={(Resource.MEMORY, "GPU-M::3"): Holder("t", "p", "c")}),
            0,
            None,
            True,
        ),
        (
            Snapshot(0.0, holders={(Resource.MEMORY, "GPU-O::3"): Holder("t", "p", "c")}),
            0,
            None,
            False,
        ),
    ],
)
def test_who_may_be_an_mps_client(
    snapshot: Snapshot, namespaces: int, claims: dict[str, list[str]] | None, live: bool
) -> None:
    assert clients_live(snapshot, {"GPU-M"}, namespaces, claims) is live


def test_the_chart_bounds_the_shm_where_mps_is_on() -> None:
    from test_deploy_manifests import chart_objects, chart_values, one

    def init_args(values: dict[str, object]) -> list[str]:
        daemonset = one(chart_objects(values), "DaemonSet")
        (init,) = daemonset["spec"]["template"]["spec"]["initContainers"]
        return list(init["args"])

    assert not any("mps-shm" in a for a in init_args(chart_values()))  # no MPS: no mount
    values = chart_values()
    values["config"]["mpsControl"] = "/usr/bin/nvidia-cuda-mps-control"  # type: ignore[index]
    assert "--mps-shm-size-mib=256" in init_args(values)


def test_the_shm_figures_pass_the_metrics_lint(tmp_path: Path) -> None:
    from kit import promlint
    from prometheus_client import CollectorRegistry, generate_latest

    shm = tmp_path / "shm"
    shm.mkdir()
    registry = CollectorRegistry()
    registry.register(MpsShmMetrics(MpsShm(shm, limit_bytes=1 << 20)))
    assert promlint.problems(generate_latest(registry).decode()) == []
