"""make gpu-bench run whole without a GPU, on the stand-ins at the edge: the C stand-in
driver (``tests/kit/standin/libcuda_standin.c``: kernels sleep, 100x longer where an SM
limit throttles them), the MPS control daemon stand-in, and an ``nvidia-smi`` that
prints a recorded card and logs how it was called.

What it shows: every step of the plan produces a measurement and the report has its
rows; the interposer's environment reaches its tenants (the throttled stand-in runs far
slower than time-slicing); under MPS v3 each tenant gets a namespace capped at its share;
the MPS daemon it started is stopped; the driver backend is
reported absent with its reason; nvidia-smi is only ever queried; and make gpu-proof's
MPS part proves a v3 namespace through gpushare's own MpsControl where the daemon has
them, and stops its daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kit.memhook import build_cuda
from kit.mps import install_standin, pid_alive

from gpushare.bench.gpu.scenarios import _finish, _go
from gpushare.bench.gpu.tenants import Running

ROOT = Path(__file__).resolve().parents[3]
UUID = "GPU-1081cd7b-52eb-fd89-c0b1-ba91b23923dd"
SMI_LINE = f"0, {UUID}, NVIDIA H200, 580.159.04, 4096, Disabled, Enabled, Default, 00000000:19:00.0"

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bin/ (nvidia-smi, nvidia-cuda-mps-control), lib/libcuda.so.1 and libvgpu.so: the
    stand-in driver, also as the interposer (its check asks for the hooks it has)."""
    where = tmp_path_factory.mktemp("gpu-machine")
    (where / "lib").mkdir()
    build_cuda(where / "lib" / "libcuda.so.1")
    shutil.copy(where / "lib" / "libcuda.so.1", where / "libvgpu.so")
    smi = where / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f'#!/bin/sh\necho "$*" >> {where}/smi.log\necho "{SMI_LINE}"\n')
    smi.chmod(0o755)
    install_standin(where / "bin")
    return where


def env(machine: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{machine / 'bin'}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "src"),
        "LD_LIBRARY_PATH": str(machine / "lib"),
        "STANDIN_LIMIT": str(8 << 30),
        "GPUSHARE_REQUIRED_HOOKS": "cuInit cuLaunchKernel",
        **extra,
    }


def test_the_bench_measures_every_present_backend_and_reports_each(
    machine: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "gpushare.bench.gpu", "--out", str(out),
         "--interposer", str(machine / "libvgpu.so"), "--hook", str(tmp_path / "none"),
         "--runs", "1", "--seconds", "0.3", "--warmup", "0.1", "--interposer-warmup", "0.1",
         "--crowd", "3"],
        capture_output=True, text=True, env=env(machine, STANDIN_MPS_V3="1"), timeout=300,
        cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    results = json.loads((out / "gpu-bench.json").read_text())
    present = [b["name"] for b in results["plan"]["backends"] if b["present"]]
    assert present == ["time-sliced", "interposer", "interposer-memory", "mps"]
    steps = {(s["scenario"], s["backend"], s["run"]) for s in results["plan"]["steps"]}
    measured = {(m["scenario"], m["backend"], m["run"]) for m in results["measurements"]}
    assert measured == steps
    by = {(m["scenario"], m["backend"], m["run"]): m for m in results["measurements"]}

    def aggregate(backend: str) -> float:
        return sum(t["rate"] for t in by[("pair", backend, 0)]["tenants"])

    # the SM limit reached the interposer's tenants: the stand-in throttles them 100x; the
    # memory-only interposer's tenants run unthrottled
    assert 0 < aggregate("interposer") < aggregate("time-sliced") / 5
    assert aggregate("interposer-memory") > aggregate("interposer") * 5
    crowd = by[("start", "time-sliced", 1)]["tenants"]
    assert len(crowd) == 3
    for tenant in crowd:
        stages = [tenant["stages"][s] for s in ("main", "init", "context", "module",
                                                "first_kernel")]  # fmt: skip
        assert stages == sorted(stages) and stages[0] > 0
    victim = by[("pressure", "time-sliced", 0)]["tenants"][1]
    assert (victim["role"], victim["asked_mib"], victim["allocated_mib"]) == ("victim", 1638, 1638)
    # under MPS v3 each tenant had a namespace of its own, capped at its share before it
    # started (no fallback to caps in its env), forgotten after
    capped = [line.split() for line in done.stdout.splitlines() if "mps_namespace_capped" in line]
    named = {w.split("=", 1)[1] for words in capped for w in words if w.startswith("namespace=")}
    assert {"pair-0-a", "pair-0-b", "pressure-0-aggressor", "pressure-0-victim"} <= named
    assert all("percent=50" in words and "mib=2048" in words for words in capped)
    mps = next(b for b in results["plan"]["backends"] if b["name"] == "mps")
    assert (mps["memory"], mps["reason"]) == ("MPS pinned limit (namespace)", "v3 namespaces")
    assert not any("env caps used" in n for n in results["notes"])
    # the MPS daemon it started is stopped again
    assert any("mps: MPS control daemon stopped" in n and "alive after stop: False" in n
               for n in results["notes"])  # fmt: skip
    report = (out / "gpu-bench.md").read_text()
    assert "| driver | | | absent: driver 580.159.04 is older than r615 |" in report
    for section in ("Throughput kept", "Isolation under pressure", "What a start costs"):
        assert f"### {section}" in report
    assert "### What failed" not in report
    # the report is rebuilt from the results file alone
    again = subprocess.run([sys.executable, "-m", "gpushare.bench.gpu", "--table",
                            str(out / "gpu-bench.json")], capture_output=True, text=True,
                           env=env(machine), check=True, timeout=60)  # fmt: skip
    assert again.stdout == report
    # nvidia-smi was asked questions, nothing else
    calls = (machine / "smi.log").read_text().splitlines()
    assert calls and all(c.startswith("--query-gpu=") for c in calls)


def test_a_tenant_that_cannot_start_fails_its_steps_not_the_run(
    machine: Path, tmp_path: Path
) -> None:
    """No memory at all on the stand-in: every tenant's first allocation fails; each step
    says so and the run ends with exit 1 and a report."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "gpushare.bench.gpu", "--out", str(out), "--backends",
         "time-sliced", "--interposer", str(tmp_path / "none"), "--runs", "1", "--seconds",
         "0.1", "--warmup", "0", "--crowd", "2"],
        capture_output=True, text=True, env=env(machine, STANDIN_LIMIT="0"), timeout=300,
        cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:]
    report = (out / "gpu-bench.md").read_text()
    failed = report[report.index("### What failed") :]
    assert "- pair time-sliced run 0: a: cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY" in failed
    assert "| interposer | | | absent: no libvgpu.so" in report
    assert "| mps | | | absent: not asked for (--backends) |" in report


def test_gpu_proofs_mps_part_proves_a_v3_namespace_and_stops_its_daemon(
    machine: Path, short_tmp: Path
) -> None:
    # the namespace's socket is <scratch>/mps/pipe/gpushare/proof30/control: under
    # tmp_path (popen-gwN/ under a parallel run) it passes the 107 bytes a unix socket
    # path may have and the stand-in daemon dies binding it
    scratch = short_tmp / "mps"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-proof-mps.py"),
         str(machine / "bin" / "nvidia-cuda-mps-control"), UUID, str(scratch)],
        capture_output=True, text=True, timeout=300,
        env=env(machine, STANDIN_MPS_V3="1", GPU_PROOF_SPIN_SECONDS="0.2",
                GPU_PROOF_SPIN_WARMUP="0"),
    )  # fmt: skip
    out = done.stdout
    assert "namespaces=True" in out, out
    # the stand-in driver ignores MPS caps, so whether a capped client passes the bar is
    # the machine's noise here: the verdicts are not asserted, that they were given is
    assert done.returncode in (0, 1), out  # 2: the daemon or a client could not run
    line = next(x for x in out.splitlines() if "v3 namespace" in x)
    assert line.startswith(("mps: ok   v3 namespace ", "mps: FAIL v3 namespace "))
    assert "capped at 30 % (nothing in the client's env)" in line
    assert f"{scratch}/mps/pipe/gpushare/proof30" in line
    state = json.loads((scratch / "mps" / "pipe" / "standin-state.json").read_text())
    assert state["protocol"] == 3
    assert "proof30" not in state["namespaces"]  # forgotten after its proof
    stopped = next(x for x in out.splitlines() if x.startswith("mps: stopped"))
    assert stopped.endswith("alive after stop: False")
    pid = int(next(x for x in out.splitlines() if x.startswith("mps: started pid")).split()[3])
    assert not pid_alive(pid)


def test_a_backend_that_cannot_be_set_up_is_reported_and_the_others_run(
    machine: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "gpushare.bench.gpu", "--out", str(out), "--backends",
         "time-sliced,mps", "--interposer", str(tmp_path / "none"), "--runs", "1",
         "--seconds", "0.1", "--warmup", "0", "--crowd", "2"],
        capture_output=True, text=True, env=env(machine, STANDIN_MPS_FAIL_START="1"),
        timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:]
    results = json.loads((out / "gpu-bench.json").read_text())
    mps = [m for m in results["measurements"] if m["backend"] == "mps"]
    assert mps and all(m["error"].startswith("setup: MPS control daemon: ") for m in mps)
    sliced = [m for m in results["measurements"] if m["backend"] == "time-sliced"]
    assert sliced and all(not m["error"] for m in sliced)
    assert any(n.startswith("mps: cannot be set up: MPS control daemon") for n in results["notes"])
    report = (out / "gpu-bench.md").read_text()
    assert "- pair mps run 0: setup: MPS control daemon: " in report


def test_a_run_cut_short_leaves_the_results_so_far(machine: Path, tmp_path: Path) -> None:
    """The device call's limit can end a run: the results file is saved after every step,
    and a SIGTERM unwinds (the report rebuilds from what was saved)."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpushare.bench.gpu", "--out", str(out), "--backends",
         "time-sliced", "--interposer", str(tmp_path / "none"), "--runs", "3", "--seconds",
         "0.2", "--warmup", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(machine),
        cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("gpu-bench: time-sliced pair run 0:"):
            proc.terminate()
            break
    proc.communicate(timeout=120)
    assert proc.returncode == 128 + 15, "".join(seen)
    saved = json.loads((out / "gpu-bench.json").read_text())
    assert saved["notes"] == ["partial: the run did not finish"]
    scenarios = [(m["scenario"], m["backend"]) for m in saved["measurements"]]
    assert ("pair", "time-sliced") in scenarios and ("control", "none") not in scenarios
    again = subprocess.run([sys.executable, "-m", "gpushare.bench.gpu", "--table",
                            str(out / "gpu-bench.json")], capture_output=True, text=True,
                           env=env(machine), check=True, timeout=60)  # fmt: skip
    assert "| time-sliced | nothing | time-slicing |" in again.stdout


def _tenant(script: str) -> Running:
    pipe = subprocess.PIPE
    proc = subprocess.Popen(["sh", "-c", script], stdin=pipe, stdout=pipe,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    running = Running("t", "a", proc)
    running.read()
    return running


def test_a_tenant_that_logs_around_its_lines_is_still_read_right() -> None:
    """An interposer logs into the same output (HAMi-core does): lines before ``ready``
    and after the result, in one write, change nothing."""
    result_line = '{"rate": 5.0, "stages": {"main": 0.1}}'
    noisy = _tenant('printf "[HAMI-core Msg] init\\nready\\n"; read go; '
                    f"printf '{result_line}\\n[HAMI-core Msg] exit\\n'")  # fmt: skip
    deadline = time.monotonic() + 60
    assert noisy.wait_ready(deadline)
    _go([noisy])
    result = _finish(noisy, deadline)
    assert (result.rate, result.error, result.stages) == (5.0, "", {"main": 0.1})


def test_a_tenant_that_never_gets_ready_is_killed_and_says_so() -> None:
    silent = _tenant("echo starting; exec sleep 600")
    assert not silent.wait_ready(time.monotonic() + 0.5)
    result = _finish(silent, time.monotonic() + 10)
    assert silent.proc.returncode is not None  # killed, not left behind
    assert result.rate == 0.0
    assert result.error.startswith("no result") and "no ready line in time" in result.error
    assert "starting" in result.error  # what it did print is kept
