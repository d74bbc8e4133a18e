"""The enforcement probe under the ``driver`` memory backend, without a GPU: the memory
hook (built by gcc) sets a container's limit through the stand-in NVML into the simulated
driver's store, and the stand-in CUDA driver (tests/kit/standin/libcuda_standin.c) checks
every allocation of the processes of that cgroup against it. The probe, told the grant
(``--memory-backend driver --limit-mib``), must find the limit held; where the hook set
nothing it must say that the limit is not enforced."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kit.memhook import HAVE_GCC, UUID, HookWorld, build, build_cuda, oci_state

from gpushare.probe import checks as probe

ROOT = Path(__file__).resolve().parents[3]
LIMIT_MIB = 1024
CARD_BYTES = 8 * LIMIT_MIB << 20

pytestmark = pytest.mark.skipif(not HAVE_GCC, reason="needs gcc")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    out = tmp_path_factory.mktemp("standins")
    hook, nvml = build(out)
    return hook, nvml, build_cuda(out / "libcuda.so.1")


def run_probe(
    cuda: Path, world: HookWorld, namespace: str, context_mib: int = 0
) -> tuple[int, list[probe.Check]]:
    env = {
        "STANDIN_CONTEXT_BYTES": str(context_mib << 20),  # a context's cost in the limit
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT / "src"),
        "NVIDIA_VISIBLE_DEVICES": UUID,
        "STANDIN_LIMIT": str(CARD_BYTES),  # the card, where the driver holds no limit
        "STANDIN_DRIVER_STORE": str(world.store.path),
        "STANDIN_GPU": UUID,
        "STANDIN_CGROUP": namespace,  # the cgroup the probe's processes are in
    }
    result = subprocess.run(
        [sys.executable, "-m", "gpushare.probe", "--library", str(cuda),
         "--memory-backend", "driver", "--limit-mib", str(LIMIT_MIB), "--spin-seconds", "0.2",
         "--spin-warmup", "0"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    checks = probe.parse_report(result.stdout)
    assert checks is not None, result.stderr
    return result.returncode, checks


def test_the_limit_the_hook_set_holds_for_the_containers_processes(
    built: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    hook, nvml, cuda = built
    world = HookWorld(tmp_path, hook, nvml)
    namespace = world.container(77, "/kubepods/pod-p/probe")
    assert world.run(oci_state(77), args=world.args(limit_mib=LIMIT_MIB)).returncode == 0
    code, checks = run_probe(cuda, world, namespace)
    by_name = {c.name: c for c in checks}
    assert code == 0, probe.verdict(checks)[1]
    assert "interposer loaded" not in by_name  # the driver holds it, no interposer expected
    assert by_name["cuMemGetInfo reports the limit"].ok
    assert by_name["cuMemAlloc_v2 stops at the limit"].ok
    assert by_name["cuMemAllocAsync cannot pass the limit"].ok
    assert by_name["two processes share one limit"].ok


def test_without_the_hooks_limit_the_probe_says_not_enforced(
    built: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    hook, nvml, cuda = built
    world = HookWorld(tmp_path, hook, nvml)
    namespace = world.container(78, "/kubepods/pod-q/probe")  # no hook run
    code, checks = run_probe(cuda, world, namespace)
    assert code == 1
    failed = probe.verdict(checks)[1]
    assert "cuMemGetInfo reports the limit" in failed
    assert "cuMemAlloc_v2 stops at the limit" in failed


def test_managed_memory_is_a_known_gap_and_the_grant_less_the_context_is_printed(
    built: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """Issue 41 items 5 and 9: the driver counts ``cudaMallocManaged`` only in system
    memory, so a managed allocation past the limit is granted: the probe reports that as
    the documented gap (GAP, neither ok nor FAIL); and a context counted inside the limit
    leaves the grant less the context allocatable, which the probe prints."""
    hook, nvml, cuda = built
    world = HookWorld(tmp_path, hook, nvml)
    namespace = world.container(79, "/kubepods/pod-r/probe")
    assert world.run(oci_state(79), args=world.args(limit_mib=LIMIT_MIB)).returncode == 0
    code, checks = run_probe(cuda, world, namespace, context_mib=256)
    by_name = {c.name: c for c in checks}
    assert code == 0, probe.verdict(checks)[1]
    managed = by_name["cuMemAllocManaged past the limit"]
    assert managed.ok is None and managed.gap and "KNOWN GAP" in managed.detail
    assert "GAP  cuMemAllocManaged past the limit: KNOWN GAP" in probe.render(checks)
    allocatable = by_name["what the grant can allocate"]
    assert "granted 1024 MiB, allocated 768 MiB" in allocatable.detail
    assert "256 MiB of the grant not allocatable" in allocatable.detail
    assert "inside the limit" in allocatable.detail
    assert by_name["cuMemAlloc_v2 stops at the limit"].ok
