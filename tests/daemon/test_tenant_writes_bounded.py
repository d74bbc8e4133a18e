"""What tenants can write below <host-lib-dir>/containers is bounded.

A tenant wrote 1 GiB (or anything) onto the host's root file system through its cache
directory; the shared lock directory was not even measured. The DaemonSet's init
container (``python -m gpushare.host.cachefs``) mounts a size-limited tmpfs over
``containers``: here it runs in a private mount namespace of its own (``unshare``), as
root like the init container, and a tenant writes through its cache directory and the
lock directory until the file system refuses.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_deploy_manifests import ROOT, chart_objects

from gpushare.host.cachefs import DEFAULT_SIZE_MIB

needs_mounts = pytest.mark.skipif(
    shutil.which("unshare") is None
    or subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0,
    reason="needs unshare --mount (root) for a private mount namespace",
)

#: Played inside the namespace: mount, Allocate's directories, a tenant filling them.
SCENARIO = r"""
import errno, json, os, sys
from pathlib import Path
from gpushare.host import cachefs, library

host = Path(sys.argv[1])
size_mib = int(sys.argv[2])
said = [cachefs.main(["--host-lib-dir", str(host), "--size-mib", str(size_mib)])]
said.append(cachefs.main(["--host-lib-dir", str(host), "--size-mib", str(size_mib)]))
bound = cachefs.bound(host)
cache = library.prepare_cache_dir(host, ["GPU-0::0"])  # what Allocate makes
lock = library.ensure_lock_dir(host)
written = {}
for name, directory in (("cache", cache), ("lock", lock)):
    total = 0
    try:
        with open(directory / "fill", "wb") as out:
            while total < 4 * size_mib << 20:
                out.write(b"x" * (1 << 20))
                out.flush()
                total += 1 << 20
        error = None
    except OSError as exc:
        error = errno.errorcode.get(exc.errno, str(exc.errno))
    written[name] = (os.stat(directory / "fill").st_blocks * 512, error)
    os.unlink(directory / "fill")
print(json.dumps({"rc": said, "own": bound.own, "type": bound.fs_type,
                  "size": bound.size_bytes, "written": written}))
"""


@needs_mounts
def test_a_tenant_cannot_write_past_the_bound(tmp_path: Path) -> None:
    size_mib = 8
    host = tmp_path / "vgpu"
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            "-c",
            SCENARIO,
            str(host),
            str(size_mib),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["rc"] == [0, 0]  # mounted, then kept (a restart)
    assert found["own"] and found["type"] == "tmpfs"
    assert found["size"] == size_mib << 20
    for name, (written, error) in found["written"].items():
        assert error == "ENOSPC", (name, error)
        assert written <= size_mib << 20, (name, written)
    # Nothing reached the host's own file system: under the mount point, nothing.
    assert list((host / "containers").iterdir()) == []
    print(f"\nbytes a tenant could write with --size-mib {size_mib}: {found['written']}")


def test_without_cap_sys_admin_the_mount_is_refused_in_one_line(tmp_path: Path) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv")
    done = subprocess.run(
        [
            "setpriv",
            "--bounding-set=-all",
            "--inh-caps=-all",
            sys.executable,
            "-m",
            "gpushare.host.cachefs",
            "--host-lib-dir",
            str(tmp_path),
            "--size-mib",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "cannot bound the cache directories" in line and "CAP_SYS_ADMIN" in line


def test_the_daemonset_and_the_chart_mount_it_before_the_daemon_starts() -> None:
    (daemonset,) = [
        d for d in yaml.safe_load_all((ROOT / "daemonset/daemonset.yaml").read_text()) if d
    ]
    pod = daemonset["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["python", "-m", "gpushare.host.cachefs"]
    assert f"--size-mib={DEFAULT_SIZE_MIB}" in init["args"]
    assert init["securityContext"] == {"privileged": True}
    (mount,) = init["volumeMounts"]
    assert mount["mountPropagation"] == "Bidirectional"
    (daemon,) = pod["containers"]
    assert daemon["securityContext"]["privileged"] is False
    host_lib = next(m for m in daemon["volumeMounts"] if m["name"] == mount["name"])
    assert host_lib["mountPropagation"] == "HostToContainer"
    assert host_lib["mountPath"] == mount["mountPath"]

    def chart_init(values: dict[str, object] | None = None) -> list[dict[str, object]]:
        (ds,) = [o for o in chart_objects(values) if o["kind"] == "DaemonSet"]
        return list(ds["spec"]["template"]["spec"].get("initContainers") or [])  # type: ignore[index]

    (chart,) = chart_init()
    assert chart["args"] == init["args"] and chart["securityContext"] == {"privileged": True}
    assert not chart_init({"cacheFs": {"sizeMib": 0}})


def test_the_shared_lock_directory_is_measured_too(tmp_path: Path) -> None:
    from gpushare.host.gc import GarbageCollector
    from gpushare.host.library import LOCK_DIR_NAME, ensure_lock_dir
    from gpushare.share.records import Snapshot

    lock = ensure_lock_dir(tmp_path)
    (lock / "filler").write_bytes(b"x" * (1 << 20))
    collector = GarbageCollector(
        tmp_path, grace_seconds=60.0, current_library=None, size_limit_bytes=1 << 19
    )
    collector.collect(Snapshot(taken_at=0.0))
    assert collector.sizes.usage[LOCK_DIR_NAME].bytes >= 1 << 20
    assert collector.sizes.total_cache_bytes() >= 1 << 20 and collector.sizes.over_limit == 1
