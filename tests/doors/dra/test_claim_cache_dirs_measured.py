"""Issue 32.3: a DRA claim's cache directory shares the bounded cache file system with
the device plugin's, so it is measured and bounded the same way: counted in
``gpushare_cache_dir_bytes``, over ``--cache-dir-limit-mib`` logged once naming the
claim and counted in ``gpushare_cache_dirs_over_limit``; never collected by the device
plugin's GC (the claim's unprepare removes it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import structlog
from conftest import NODE, TESLA_P4, Node, cards
from kit.kube_double import KubeApiDouble
from kit.procs import free_port, poll, scrape

from gpushare.sim.drakubeletdouble import DraKubelet, allocated_claim

DRIVER = "gpu.gpushare.io"
MIB = 1 << 20


def claim_cache_dir(cdi: Path, uid: str) -> Path:
    spec = json.loads((cdi / f"{DRIVER}-claim_{uid}.json").read_text())
    (device,) = spec["devices"]
    mounts = device["containerEdits"]["mounts"]
    return Path(next(m["hostPath"] for m in mounts if m["containerPath"].endswith("/cache")))


def metric(port: int, name: str) -> float:
    (line,) = [x for x in scrape(port)[1].splitlines() if x.startswith(f"{name} ")]
    return float(line.split()[1])


def test_a_claims_cache_directory_is_measured_and_bounded(node: Node, api: KubeApiDouble) -> None:
    port = free_port()
    daemon = node.start(
        cards(TESLA_P4, 2),
        card_modes="1=dra",
        node_name=NODE,
        dra_kubelet_root=str(node.root / "kubelet"),
        dra_cdi_dir=str(node.root / "cdi"),
        dra_resync_seconds=0.05,
        gc_grace_seconds=0.2,
        pod_resources_interval_seconds=0.05,
        cache_dir_limit_mib=1,
        metrics_port=port,
        metrics_address="127.0.0.1",
    )
    kubelet = DraKubelet(node.root / "kubelet")
    kubelet.register()
    try:
        result = {"request": "gpu", "device": "gpu-1", "consumedCapacity": {"memory": "1Gi"}}
        obj = api.add(allocated_claim("ml", "filler", DRIVER, NODE, [result]))
        ref = ("ml", "filler", obj["metadata"]["uid"])
        (answer,) = kubelet.prepare([ref]).values()
        assert answer.error == ""
        cache = claim_cache_dir(node.root / "cdi", ref[2])
        collector = daemon.core.collector
        with structlog.testing.capture_logs() as logs:
            with (cache / "fill").open("wb") as out:  # the tenant fills the shared bound
                out.write(os.urandom(3 << 20))
                out.flush()
                os.fsync(out.fileno())
            assert poll(lambda: collector.sizes.over_limit == 1, 20.0)
        over = [e for e in logs if e["event"] == "cache_dir_over_limit"]
        assert len(over) == 1 and over[0]["holder"] == "claim ml/filler"
        # The measurement may land while the write is under way: over the limit, maybe not all.
        assert over[0]["key"] == cache.name and over[0]["bytes"] > 1 << 20
        assert metric(port, "gpushare_cache_dirs_over_limit") == 1.0
        assert poll(lambda: metric(port, "gpushare_cache_dir_bytes") >= 3 << 20, 20.0)
        # passes later (the grace period long over), the claim's directory is still there
        for _ in range(2):
            last = collector._last_run
            assert poll(lambda last=last: collector._last_run != last, 20.0)
        assert cache.is_dir() and (cache / "fill").exists()
        assert kubelet.unprepare([ref]) == {ref[2]: ""}
        assert poll(lambda: collector.sizes.over_limit == 0, 20.0)
    finally:
        kubelet.close()


#: In a private mount namespace: the bound mounted, a DRA claim's tenant filling it,
#: then the next device-plugin container's directory made as Allocate makes it.
FILLED = r"""
import errno, json, sys
from pathlib import Path
from gpushare.host import cachefs, library
host = Path(sys.argv[1])
cachefs.main(["--host-lib-dir", str(host), "--size-mib", "4"])
claim = library.prepare_claim_cache_dir(host, library.claim_cache_key("u", "r", "gpu-1"))
try:
    with open(claim / "fill", "wb") as out:
        while True:
            out.write(b"x" * (1 << 20))
            out.flush()
except OSError as exc:
    full = errno.errorcode.get(exc.errno, str(exc.errno))
try:
    made = str(library.prepare_cache_dir(host, ["GPU-0::0", "GPU-0::1"]))
except OSError as exc:
    made = f"refused: {exc}"
print(json.dumps({"full": full, "made": made}))
"""


def test_a_full_cache_file_system_does_not_refuse_the_next_container(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    import pytest

    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0
    ):
        pytest.skip("needs unshare --mount (root) for a private mount namespace")
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            "-c",
            FILLED,
            str(tmp_path / "vgpu"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["full"] == "ENOSPC"
    assert not found["made"].startswith("refused"), found  # Allocate was refused before
    assert "cache_record_not_written" in done.stdout + done.stderr
