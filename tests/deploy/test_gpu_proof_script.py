"""``make gpu-proof`` (scripts/gpu-proof.sh) without a GPU: it parses, and its dry run
prints the facts that decide the backends and the plan, runs nothing and exits 0."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-proof.sh"


def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], timeout=30).returncode == 0


def test_the_dry_run_prints_the_facts_and_the_plan(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(SCRIPT), "--dry-run", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},  # no nvidia-smi
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(line.startswith("gpu-proof: ") for line in lines)
    text = result.stdout
    assert "driver version: no nvidia-smi here" in text
    assert "cgroup file system at /sys/fs/cgroup: " in text
    assert "mps control: no nvidia-cuda-mps-control here" in text  # else its -p 3 -h
    # issue 41 item 6: the persistence mode among the facts, and the hook's time promised
    assert "persistence mode: unknown (no nvidia-smi)" in text
    assert "hook timing: the memory hook (or NVML's open) is timed cold and with NVML held" in text
    assert "backends to prove: interposer (not driver: no driver)\n" in text  # and no mps
    assert "dry run: nothing run" in text
    assert os.listdir(tmp_path / "out") == []  # nothing run, nothing written


def test_the_plan_proves_mps_where_its_control_daemon_is_found(tmp_path: Path) -> None:
    control = tmp_path / "bin" / "nvidia-cuda-mps-control"
    control.parent.mkdir()
    control.write_text("#!/bin/sh\necho 'nvidia-cuda-mps-control [options] [command]'\n")
    control.chmod(0o755)
    result = subprocess.run(
        [str(SCRIPT), "--dry-run", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={"PATH": f"{control.parent}:/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"mps control: {control}" in result.stdout
    assert "backends to prove: interposer mps (not driver: no driver)" in result.stdout


def test_a_bad_option_is_a_usage_error() -> None:
    result = subprocess.run([str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "usage:" in result.stderr
