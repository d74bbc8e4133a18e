"""One tenant of the GPU benchmark (``bench/gpu/worker.py``) without a GPU: its arguments
and result line, its allocation in steps, the kernel it loads and launches, and its
counted window, against driver stand-ins at the edge (a Python one that records the
calls; the C stand-in ``tests/kit/standin/libcuda_standin.c`` for the process whole).

What it proves: the last line is one JSON object, with ``error`` (exit 1) where the
driver cannot be loaded, never a traceback alone; ``--no-cuda`` reports the
interpreter's start only; memory is taken in ``--chunk-mib`` steps up to what was
asked and stops at the first refusal, naming it; the kernel is the probe's PTX launched
on the asked grid in batches with one synchronisation each; the stages are timed from
the parent's clock in their order; ``--gate`` waits for a line before ``cuInit``.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kit.memhook import build_cuda

from gpushare.bench.gpu import worker
from gpushare.bench.gpu.records import TenantResult
from gpushare.probe.cuda import CUDA_SUCCESS, SPIN_PTX

ROOT = Path(__file__).resolve().parents[3]
OUT_OF_MEMORY = 2


class RecordingDriver:
    """The CUDA driver at the edge: every call recorded; allocations refused once
    ``free`` bytes are used up."""

    def __init__(self, free: int = 1 << 62) -> None:
        self.free = free
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._next = 0x1000

    def try_call(self, name: str, *args: Any) -> int:
        self.calls.append((name, args))
        if name == "cuMemAlloc_v2":
            size = args[1].value
            if size > self.free:
                return OUT_OF_MEMORY
            self.free -= size
            args[0]._obj.value = self._next
            self._next += 0x1000
        return CUDA_SUCCESS

    def call(self, name: str, *args: Any) -> None:
        assert self.try_call(name, *args) == CUDA_SUCCESS

    def error_name(self, code: int) -> str:
        return {OUT_OF_MEMORY: "CUDA_ERROR_OUT_OF_MEMORY"}.get(code, f"CUresult {code}")


def last_json(text: str) -> dict[str, Any]:
    lines = text.strip().splitlines()
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    return result


# -- the process's result -----------------------------------------------------------------


def test_no_cuda_reports_the_interpreters_start_only(capsys: pytest.CaptureFixture[str]) -> None:
    t0 = worker._MAIN - 1.5
    assert worker.main(["--no-cuda", "--t0", repr(t0)]) == 0
    result = last_json(capsys.readouterr().out)
    assert result == {"stages": {"main": worker._MAIN - t0}}
    assert TenantResult.parse(json.dumps(result)).error == ""


def test_a_driver_that_cannot_be_loaded_is_an_error_in_the_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "libcuda.so.1"
    assert worker.main(["--library", str(missing), "--t0", "0"]) == 1
    result = last_json(capsys.readouterr().out)
    assert str(missing) in result["error"] and len(result["error"]) <= 500
    assert list(result["stages"]) == ["main"]  # it got no further
    parsed = TenantResult.parse(json.dumps(result), "victim")
    assert parsed.error == result["error"] and parsed.role == "victim"


def test_a_misspelt_option_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        worker.main(["--alloc", "64"])  # not taken for --alloc-mib
    assert exit_.value.code == 2
    assert "--alloc" in capsys.readouterr().err


# -- its parts, against a driver that records ------------------------------------------


@given(st.integers(0, 4096), st.integers(1, 1024), st.integers(0, 8192))
def test_memory_is_taken_in_chunks_up_to_the_ask_until_the_first_refusal(
    total: int, chunk: int, free_mib: int
) -> None:
    driver = RecordingDriver(free=free_mib * worker.MIB)
    got, refused, pointers = worker.allocate(driver, total, chunk)
    sizes = [args[1].value // worker.MIB for name, args in driver.calls]
    assert all(name == "cuMemAlloc_v2" for name, _args in driver.calls)
    assert all(0 < s <= chunk for s in sizes) and all(s == chunk for s in sizes[:-1])
    assert len(pointers) == len(set(pointers))
    if refused:
        assert refused == "CUDA_ERROR_OUT_OF_MEMORY"
        assert got < total and got + sizes[-1] > free_mib  # stopped at the first refusal
        assert got == sum(sizes[:-1]) and len(pointers) == len(sizes) - 1
    else:
        assert got == total == sum(sizes) and len(pointers) == len(sizes)


def test_the_kernel_is_the_probes_ptx_on_the_asked_grid() -> None:
    driver = RecordingDriver()
    kernel = worker.Kernel(driver, blocks=64, threads=128, iters=500)
    loaded = [name for name, _args in driver.calls]
    assert loaded == ["cuModuleLoadData", "cuModuleGetFunction", "cuMemAlloc_v2"]
    assert driver.calls[0][1][1].value == SPIN_PTX.rstrip(b"\x00")  # NUL-ended for the driver
    assert driver.calls[1][1][2] == b"spin"
    assert driver.calls[2][1][1].value == 64 * 128 * 4  # one word per thread
    driver.calls.clear()
    kernel.run(3)
    assert [name for name, _args in driver.calls] == ["cuLaunchKernel"] * 3 + ["cuCtxSynchronize"]
    grid = driver.calls[0][1][1:7]
    assert grid == (64, 1, 1, 128, 1, 1)
    assert ctypes.c_uint32.from_address(kernel.params[1]).value == 500  # the iterations


def test_the_window_counts_launches_in_batches() -> None:
    driver = RecordingDriver()
    kernel = worker.Kernel(driver, blocks=1, threads=1, iters=1)
    driver.calls.clear()
    rate = worker.window(kernel, warmup=0.0, seconds=0.01, batch=5)
    assert rate > 0
    launches = [name for name, _args in driver.calls if name == "cuLaunchKernel"]
    syncs = [name for name, _args in driver.calls if name == "cuCtxSynchronize"]
    assert len(launches) == 5 * len(syncs) > 0


# -- the process whole, on the C stand-in driver ----------------------------------------


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    return build_cuda(tmp_path_factory.mktemp("standin") / "libcuda.so.1")


def tenant(standin: Path, *args: str, stdin: str = "") -> tuple[int, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"),
           "STANDIN_LIMIT": str(512 * worker.MIB + 4096)}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "gpushare.bench.gpu.worker", "--library", str(standin),
         "--blocks", "1", "--threads", "1", *args],
        input=stdin, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    return done.returncode, last_json(done.stdout)


def test_a_tenant_reports_each_stage_in_order_and_what_memory_it_got(standin: Path) -> None:
    code, result = tenant(standin, "--alloc-mib", "1024", "--chunk-mib", "256", "--start-only",
                          "--gate", stdin="go\n")  # fmt: skip
    assert code == 0 and "error" not in result and "rate" not in result  # --start-only
    stages = result["stages"]
    order = ["main", "gate", "init", "context", "module", "first_kernel"]
    assert list(stages) == order
    assert [stages[s] for s in order] == sorted(stages[s] for s in order)
    assert (result["asked_mib"], result["allocated_mib"]) == (1024, 512)
    assert result["alloc_error"] == "CUDA_ERROR_OUT_OF_MEMORY"


def test_a_tenant_counts_its_window_after_the_ready_line(standin: Path) -> None:
    code, result = tenant(standin, "--ready", "--warmup", "0", "--seconds", "0.05",
                          "--batch", "2", stdin="go\n")  # fmt: skip
    assert code == 0 and result["rate"] > 0
    assert list(result["stages"]) == ["main", "init", "context", "module", "first_kernel"]
