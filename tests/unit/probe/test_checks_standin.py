"""The enforcement probe run whole, without a GPU, against a stand-in driver.

``tests/kit/standin/libcuda_standin.c`` (built by gcc here) answers the probe's CUDA calls
and keeps an interposer's memory limit the way HAMi-core does (shared by the processes
of one accounting file); switches make it fail the way real interposers fail. The probe
must find the first enforced and name what is not in the others. NVML is absent here:
that check says so (not measured) instead of failing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kit.memhook import build_cuda

from gpushare.probe import checks as probe

ROOT = Path(__file__).resolve().parents[3]
LIMIT = 1 << 30

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # named like the interposer, so that the probe finds it mapped as the preload
    out = tmp_path_factory.mktemp("standin") / "libvgpu.so"
    return build_cuda(out)


def run_probe(
    library: Path, tmp_path: Path, warmup: float = 0.0, **extra: str
) -> tuple[int, list[probe.Check]]:
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT / "src"),
        "NVIDIA_VISIBLE_DEVICES": "GPU-00000000-0000-4000-8000-000000000000",
        "LD_PRELOAD": str(library),
        "CUDA_DEVICE_MEMORY_LIMIT_0": f"{LIMIT >> 20}m",
        "CUDA_DEVICE_SM_LIMIT": "30",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "vgpu.cache"),
        "STANDIN_LIMIT": str(LIMIT),
        **extra,
    }
    result = subprocess.run(
        [sys.executable, "-m", "gpushare.probe", "--library", str(library),
         "--spin-seconds", "0.3", "--spin-warmup", str(warmup)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    checks = probe.parse_report(result.stdout)
    assert checks is not None, result.stderr
    return result.returncode, checks


def failed(checks: list[probe.Check]) -> list[str]:
    return probe.verdict(checks)[1]


def test_an_enforcing_driver_gets_the_verdict_enforced(library: Path, tmp_path: Path) -> None:
    code, checks = run_probe(library, tmp_path)
    assert code == 0, failed(checks)
    by_name = {c.name: c for c in checks}
    assert by_name["interposer loaded"].ok
    assert by_name["two processes share one limit"].ok
    assert by_name["compute at the core limit"].ok
    assert by_name["NVML reports the limit"].ok is None  # no NVML here: not measured


@pytest.mark.parametrize(
    "switch,names",
    [
        ({"STANDIN_BYPASS_ASYNC": "1"}, ["cuMemAllocAsync cannot pass the limit"]),
        ({"STANDIN_PER_PROCESS": "1"}, ["two processes share one limit"]),
        ({"STANDIN_LIMIT": str(8 * LIMIT)},
         ["cuMemGetInfo reports the limit", "cuMemAlloc_v2 stops at the limit",
          "cuMemAllocAsync cannot pass the limit", "cuMemCreate cannot pass the limit",
          "cuMemAllocManaged past the limit", "two processes share one limit"]),
        # at a 10 % limit the check passes only at 20 % of the free run's throughput: a
        # machine busy enough to slow the second run 2x (0.5 at 30 %) does not pass it
        ({"GPU_CORE_UTILIZATION_POLICY": "disable", "CUDA_DEVICE_SM_LIMIT": "10"},
         ["compute at the core limit"]),
    ],
)  # fmt: skip
def test_what_is_not_enforced_is_named_and_exits_1(
    library: Path, tmp_path: Path, switch: dict[str, str], names: list[str]
) -> None:
    code, checks = run_probe(library, tmp_path, **switch)
    assert code == 1
    assert failed(checks) == names


def test_the_compute_run_is_counted_after_the_limiters_first_burst(
    library: Path, tmp_path: Path
) -> None:
    """HAMi-core lets a process launch unthrottled until its first bucket of tokens is
    spent (2-3 s on an H200): counted from the first launch, the run measures that burst
    and calls a working limiter broken; counted after a longer warm-up, it measures the
    limit."""
    burst = {"STANDIN_BURST_SECONDS": "0.6"}
    code, checks = run_probe(library, tmp_path, **burst)
    assert code == 1
    assert failed(checks) == ["compute at the core limit"]
    code, checks = run_probe(library, tmp_path, warmup=1.0, **burst)
    assert code == 0, failed(checks)
    assert "counted after 1 s of launches" in {c.name: c for c in checks}[
        "compute at the core limit"
    ].detail
