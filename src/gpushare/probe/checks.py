"""The enforcement probe: run inside a container given gpushare units, it checks that
the limits the daemon handed out are really enforced there, and prints a verdict.

``python -m gpushare.probe`` needs nothing in the container but Python, the NVIDIA
driver's libraries the container runtime injects (``libcuda.so.1`` through ctypes, see
:mod:`gpushare.probe.cuda`; ``libnvidia-ml.so.1`` through pynvml) and, for the limits to
hold, HAMi-core's ``libvgpu.so`` loaded by the preload. It checks:

* **what the container sees**: one card in ``NVIDIA_VISIBLE_DEVICES``, the interposer
  named by ``LD_PRELOAD`` or ``/etc/ld.so.preload`` *and* mapped into this process;
* **memory**: ``cuMemGetInfo`` and NVML report the limit as the total;
  ``cuMemAlloc_v2`` stops with ``CUDA_ERROR_OUT_OF_MEMORY`` at the limit;
  ``cuMemAllocAsync`` and ``cuMemCreate`` (known to bypass some HAMi-core versions)
  cannot take more than the limit either; two processes of the container share one limit;
  ``cuMemAllocManaged`` (``cudaMallocManaged``) past the limit: under the driver's limit a
  **known gap** (the driver counts managed memory only in system memory), reported as
  such, never as a pass; what the grant really lets a program allocate (the grant less
  this process's context where the limit counts it) and the card's reserved memory;
* **compute**: a busy kernel's throughput at the core limit against a run in a child
  process with the limiter off (its own accounting file, no SM limit), each counted
  after a warm-up of launches: HAMi-core's limiter starts a process with a full bucket
  of tokens and throttles only once it has spent them (about 3 s on an H200,
  docs/gpu-proof.md), so a run that short measures the bucket, not the limit.

Exit status 0 when every limit holds, 1 when one does not (the report says which), 2
when the probe cannot run (no driver, no card). The last line of the output is
``GPUSHARE-VERIFY <json>``, which ``kubectl gpushare verify`` reads from the pod's log.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

REPORT_MARKER = "GPUSHARE-VERIFY "
MIB = 1 << 20
#: A reported total may differ from the limit by this much (rounding, reserved memory).
TOTAL_SLACK = 0.02
#: Allocation may exceed the limit by this much before it counts as not enforced
#: (HAMi-core allows 10 % over in some versions' checks; we are stricter than that).
ALLOC_SLACK = 0.02
#: How far past the limit allocation is pushed before giving up on an OOM.
ALLOC_CEILING = 1.5
#: The compute run's length, seconds (counted after the warm-up).
SPIN_SECONDS = 3.0
#: Launches before the compute run is counted, seconds: longer than HAMi-core's first
#: bucket of tokens lasts (2-3 s measured on an H200, docs/gpu-proof.md).
SPIN_WARMUP_SECONDS = 4.0


@dataclass(frozen=True)
class Check:
    """One finding. ``ok`` None: not measured here (not applicable or not possible), or,
    with ``gap``, a known gap of the backend: documented, neither passed nor failed."""

    name: str
    ok: bool | None
    detail: str
    limit: str = ""  # which limit it proves: "memory", "compute" or "" (what is seen)
    gap: bool = False  # a known gap (docs/choosing.md), shown as GAP


def parse_size(text: str) -> int | None:
    """``CUDA_DEVICE_MEMORY_LIMIT_0`` as HAMi-core reads it: bytes, or a k/m/g suffix."""
    text = text.strip().lower()
    factor = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "kmg" and text else text
    return int(digits) * factor if digits.isdigit() else None


# -- what the container sees -------------------------------------------------------------


def seen_checks(env: Mapping[str, str], maps: str, preload_file: str) -> list[Check]:
    visible = [d for d in env.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    checks = [
        Check(
            "one card visible",
            len(visible) == 1 and visible[0].startswith(("GPU-", "MIG-")),
            f"NVIDIA_VISIBLE_DEVICES={env.get('NVIDIA_VISIBLE_DEVICES', '(unset)')}",
        )
    ]
    named = "libvgpu.so" in env.get("LD_PRELOAD", "") or "libvgpu.so" in preload_file
    mapped = "libvgpu.so" in maps
    how = []
    if "libvgpu.so" in env.get("LD_PRELOAD", ""):
        how.append("LD_PRELOAD")
    if "libvgpu.so" in preload_file:
        how.append("/etc/ld.so.preload")
    checks.append(
        Check(
            "interposer loaded",
            named and mapped,
            f"named by {' and '.join(how) or 'nothing'}; "
            f"{'mapped into this process' if mapped else 'NOT mapped into this process'}",
            "memory",
        )
    )
    return checks


# -- memory --------------------------------------------------------------------------------


def judge_total(name: str, total: int, limit: int) -> Check:
    ok = abs(total - limit) <= limit * TOTAL_SLACK
    return Check(name, ok, f"total {total // MIB} MiB, limit {limit // MIB} MiB", "memory")


def judge_allocation(name: str, allocated: int, limit: int, stopped: bool) -> Check:
    """``allocated``: bytes obtained before the first OOM (``stopped``) or the ceiling."""
    if not stopped:
        return Check(name, False, f"no OOM up to {allocated // MIB} MiB (limit {limit // MIB})",
                     "memory")  # fmt: skip
    ok = allocated <= limit * (1 + ALLOC_SLACK)
    return Check(
        name,
        ok,
        f"stopped with CUDA_ERROR_OUT_OF_MEMORY after {allocated // MIB} MiB "
        f"(limit {limit // MIB} MiB)",
        "memory",
    )


def judge_bypass(name: str, code: int, size: int, limit: int, unsupported: bool) -> Check:
    if unsupported:
        return Check(name, None, "not supported by this driver or card", "memory")
    ok = code != 0
    what = "refused" if ok else "GRANTED"
    return Check(
        name, ok, f"one {size // MIB} MiB allocation over the {limit // MIB} MiB limit: {what}",
        "memory",
    )  # fmt: skip


MANAGED = "cuMemAllocManaged past the limit"


def judge_managed(code: int, size: int, limit: int, backend: str, unsupported: bool) -> Check:
    """One managed (``cudaMallocManaged``) allocation past the limit. The driver's limit
    does not count managed memory (only system memory does): granted there is the
    documented gap, reported as one; under the interposer granted is not enforced."""
    if unsupported:
        return Check(MANAGED, None, "managed memory not supported here", "memory")
    over = f"one {size // MIB} MiB managed allocation over the {limit // MIB} MiB limit"
    if code != 0:
        return Check(MANAGED, True, f"{over}: refused", "memory")
    if backend == "driver":
        return Check(
            MANAGED,
            None,
            f"KNOWN GAP: {over}: granted. The driver counts managed (UVM) memory only in "
            "system memory, not against the GPU limit (docs/choosing.md)",
            "memory",
            gap=True,
        )
    return Check(MANAGED, False, f"{over}: GRANTED", "memory")


def judge_allocatable(
    limit: int, allocated: int, backend: str, total: int | None, reserved: int | None
) -> Check:
    """What the grant really gives a program: ``allocated`` before the first OOM, with
    this process's context open (the driver counts the context inside the limit; the
    interposer does not), and the card's total and driver-reserved memory where NVML
    tells them (nvmlMemory_v2). Informational: a report, never a verdict."""
    lost = max(limit - allocated, 0)
    where = (
        "inside the limit (the driver counts it)"
        if backend == "driver"
        else "outside the limit, on the card's memory (the interposer does not count it)"
    )
    card = ""
    if total is not None:
        card = f"; the card: {total // MIB} MiB total"
        card += f", {reserved // MIB} MiB reserved by the driver" if reserved is not None else ""
    return Check(
        "what the grant can allocate",
        None,
        f"granted {limit // MIB} MiB, allocated {allocated // MIB} MiB in one process with "
        f"its context open ({lost // MIB} MiB of the grant not allocatable); the context "
        f"is {where}{card}",
        "memory",
    )


def judge_shared(name: str, child: int, parent: int, limit: int) -> Check:
    ok = child + parent <= limit * (1 + ALLOC_SLACK)
    return Check(
        name,
        ok,
        f"second process holds {child // MIB} MiB, first then got {parent // MIB} MiB; "
        f"together {(child + parent) // MIB} MiB of a {limit // MIB} MiB limit",
        "memory",
    )


def judge_compute(
    throttled: float, free: float, sm_limit: int, warmup: float = SPIN_WARMUP_SECONDS
) -> Check:
    name = "compute at the core limit"
    if not 0 < sm_limit < 100:
        return Check(name, None, f"CUDA_DEVICE_SM_LIMIT={sm_limit}: not throttled by design")
    if free <= 0:
        return Check(name, None, "no unthrottled run to compare with", "compute")
    ratio = throttled / free
    ok = ratio <= sm_limit / 100 * 1.5 + 0.05
    return Check(
        name,
        ok,
        f"throughput {ratio:.0%} of an unthrottled run at a limit of {sm_limit} %, "
        f"counted after {warmup:g} s of launches (the limiter is soft: a short overshoot "
        "is normal)",
        "compute",
    )


# -- running it ----------------------------------------------------------------------------


def _allocate_until_oom(driver: Any, chunk: int, ceiling: int) -> tuple[int, bool, list[int]]:
    from gpushare.probe.cuda import CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS

    pointers: list[int] = []
    total = 0
    while total < ceiling:
        pointer = ctypes.c_uint64()
        code = driver.try_call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(chunk))
        if code == CUDA_ERROR_OUT_OF_MEMORY:
            return total, True, pointers
        if code != CUDA_SUCCESS:
            driver.call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(chunk))
        pointers.append(pointer.value)
        total += chunk
    return total, False, pointers


def _free(driver: Any, pointers: Sequence[int]) -> None:
    for pointer in pointers:
        driver.try_call("cuMemFree_v2", ctypes.c_uint64(pointer))


def _context(driver: Any) -> Any:
    driver.call("cuInit", 0)
    device = ctypes.c_int()
    driver.call("cuDeviceGet", ctypes.byref(device), 0)
    context = ctypes.c_void_p()
    driver.call("cuCtxCreate_v2", ctypes.byref(context), 0, device)
    return context


def _bypass_async(driver: Any, size: int) -> tuple[int, bool]:
    from gpushare.probe.cuda import CUDA_SUCCESS

    stream = ctypes.c_void_p()
    driver.call("cuStreamCreate", ctypes.byref(stream), 0)
    pointer = ctypes.c_uint64()
    code = driver.try_call("cuMemAllocAsync", ctypes.byref(pointer), ctypes.c_size_t(size), stream)
    if code == CUDA_SUCCESS:
        driver.try_call("cuMemFreeAsync", pointer, stream)
    driver.try_call("cuStreamSynchronize", stream)
    driver.try_call("cuStreamDestroy_v2", stream)
    return code, driver.error_name(code) == "CUDA_ERROR_NOT_SUPPORTED"


def _managed(driver: Any, size: int) -> tuple[int, bool]:
    from gpushare.probe.cuda import CU_MEM_ATTACH_GLOBAL, CUDA_SUCCESS

    pointer = ctypes.c_uint64()
    code = driver.try_call(
        "cuMemAllocManaged", ctypes.byref(pointer), ctypes.c_size_t(size), CU_MEM_ATTACH_GLOBAL
    )
    if code == CUDA_SUCCESS:
        driver.try_call("cuMemFree_v2", pointer)
    return code, driver.error_name(code) == "CUDA_ERROR_NOT_SUPPORTED"


def _bypass_create(driver: Any, limit: int) -> tuple[int, int, bool]:
    from gpushare.probe.cuda import (
        CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        CU_MEM_ALLOCATION_TYPE_PINNED,
        CU_MEM_LOCATION_TYPE_DEVICE,
        CUDA_SUCCESS,
        MemAllocationProp,
    )

    prop = MemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    granularity = ctypes.c_size_t()
    code = driver.try_call(
        "cuMemGetAllocationGranularity",
        ctypes.byref(granularity),
        ctypes.byref(prop),
        CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    )
    if code != CUDA_SUCCESS:
        return code, 0, True
    step = max(granularity.value, 1)
    size = (limit + 64 * MIB + step - 1) // step * step
    handle = ctypes.c_ulonglong()
    code = driver.try_call(
        "cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), 0
    )
    if code == CUDA_SUCCESS:
        driver.try_call("cuMemRelease", handle)
    return code, size, driver.error_name(code) == "CUDA_ERROR_NOT_SUPPORTED"


def spin_throughput(
    driver: Any, seconds: float = SPIN_SECONDS, warmup: float = SPIN_WARMUP_SECONDS
) -> float:
    """Kernels completed per second over ``seconds`` of back-to-back launches, counted
    after ``warmup`` seconds of the same launches."""
    from gpushare.probe.cuda import SPIN_PTX

    blocks, threads, iters = 1024, 256, 20000
    module = ctypes.c_void_p()
    driver.call("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(SPIN_PTX))
    function = ctypes.c_void_p()
    driver.call("cuModuleGetFunction", ctypes.byref(function), module, b"spin")
    out = ctypes.c_uint64()
    driver.call("cuMemAlloc_v2", ctypes.byref(out), ctypes.c_size_t(blocks * threads * 4))
    arg_out = ctypes.c_uint64(out.value)
    arg_iters = ctypes.c_uint32(iters)
    params = (ctypes.c_void_p * 2)(
        ctypes.cast(ctypes.byref(arg_out), ctypes.c_void_p),
        ctypes.cast(ctypes.byref(arg_iters), ctypes.c_void_p),
    )
    def launch() -> None:
        driver.call("cuLaunchKernel", function, blocks, 1, 1, threads, 1, 1, 0, None, params, None)
        driver.call("cuCtxSynchronize")

    warm_until = time.perf_counter() + warmup
    while time.perf_counter() < warm_until:
        launch()
    done = 0
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        launch()
        done += 1
    elapsed = time.perf_counter() - began
    driver.try_call("cuMemFree_v2", out)
    driver.try_call("cuModuleUnload", module)
    return done / elapsed


def _nvml_total() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    finally:
        pynvml.nvmlShutdown()


def _nvml_card() -> tuple[int | None, int | None]:
    """(total, reserved) of the visible card from ``nvmlDeviceGetMemoryInfo`` version 2
    (the driver's reservation is its ``reserved``); None where NVML cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no pynvml, or no libnvidia-ml in this container
        return None, None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            return int(info.total), int(info.reserved)
        except (pynvml.NVMLError, AttributeError, TypeError):
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), None
    except Exception:
        return None, None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def run(
    env: Mapping[str, str],
    library: str = "libcuda.so.1",
    spin_seconds: float = SPIN_SECONDS,
    memory_backend: str = "interposer",
    limit_mib: int | None = None,
    spin_warmup: float = SPIN_WARMUP_SECONDS,
) -> list[Check]:
    """Every check, in this process (and the two child processes it starts). Under the
    ``driver`` memory backend nothing in the container names the limit (the driver holds
    it on the container's cgroup): ``limit_mib`` is the grant to hold it to, and no
    interposer is expected."""
    from gpushare.probe.cuda import Driver

    maps = _read("/proc/self/maps")
    checks = seen_checks(env, maps, _read("/etc/ld.so.preload"))
    if memory_backend == "driver":
        checks = [checks[0]]  # the driver, not an interposer, holds the memory limit
        limit = limit_mib << 20 if limit_mib else None
    else:
        limit = parse_size(env.get("CUDA_DEVICE_MEMORY_LIMIT_0", ""))
    driver = Driver(library)
    context = _context(driver)
    if limit:
        checks += _memory_checks(driver, env, limit, memory_backend, library)
    else:
        checks.append(Check("memory limit", None, "no CUDA_DEVICE_MEMORY_LIMIT_0: not limited"))
    sm_limit = int(env.get("CUDA_DEVICE_SM_LIMIT", "0") or 0)
    throttles = 0 < sm_limit < 100
    throttled = spin_throughput(driver, spin_seconds, spin_warmup) if throttles else 0.0
    driver.try_call("cuCtxDestroy_v2", context)
    free_rate = _free_rate(env, library, spin_seconds, spin_warmup) if throttles else 0.0
    checks.append(judge_compute(throttled, free_rate, sm_limit, spin_warmup))
    return checks


def _memory_checks(
    driver: Any, env: Mapping[str, str], limit: int, memory_backend: str, library: str
) -> list[Check]:
    """What the process can do against its memory ``limit`` (bytes): what the driver
    reports, how far plain allocations go, what the grant can really hold, the ways
    around an interposer (asynchronous, virtual, managed memory) and a second process."""
    checks: list[Check] = []
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    driver.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
    checks.append(judge_total("cuMemGetInfo reports the limit", total.value, limit))
    checks.append(_nvml_check(limit))
    chunk = max(limit // 64, 2 * MIB)
    got, stopped, pointers = _allocate_until_oom(driver, chunk, int(limit * ALLOC_CEILING))
    _free(driver, pointers)
    checks.append(judge_allocation("cuMemAlloc_v2 stops at the limit", got, limit, stopped))
    checks.append(judge_allocatable(limit, got, memory_backend, *_nvml_card()))
    size = limit + 64 * MIB
    code, unsupported = _bypass_async(driver, size)
    checks.append(judge_bypass("cuMemAllocAsync cannot pass the limit", code, size, limit,
                               unsupported))  # fmt: skip
    code, size, unsupported = _bypass_create(driver, limit)
    checks.append(judge_bypass("cuMemCreate cannot pass the limit", code, size, limit,
                               unsupported))  # fmt: skip
    size = limit + 64 * MIB
    code, unsupported = _managed(driver, size)
    checks.append(judge_managed(code, size, limit, memory_backend, unsupported))
    checks.append(_two_processes(driver, env, limit, chunk, library))
    return checks


def _free_rate(
    env: Mapping[str, str], library: str, spin_seconds: float, spin_warmup: float
) -> float:
    """The same spin's rate in a child process with the compute limit taken away: the
    yardstick a throttled rate is judged against."""
    child = ["--spin", "--spin-seconds", str(spin_seconds), "--spin-warmup", str(spin_warmup),
             "--library", library]  # fmt: skip
    free_env = _unthrottled(env)
    try:
        return _child_float(child, free_env)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(free_env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])


def _unthrottled(env: Mapping[str, str]) -> dict[str, str]:
    """The child's environment for the baseline: its own accounting file, no SM limit."""
    free = dict(env)
    free.update(
        CUDA_DEVICE_SM_LIMIT="0",
        GPU_CORE_UTILIZATION_POLICY="disable",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=f"/tmp/gpushare-probe-{os.getpid()}.cache",
    )
    return free


def _nvml_check(limit: int) -> Check:
    name = "NVML reports the limit"
    try:
        total = _nvml_total()
    except Exception as exc:  # pynvml.NVMLError and a missing libnvidia-ml alike
        return Check(name, None, f"NVML not available: {str(exc)[:200]}", "memory")
    return judge_total(name, total, limit)


def _two_processes(
    driver: Any, env: Mapping[str, str], limit: int, chunk: int, library: str
) -> Check:
    name = "two processes share one limit"
    hold = (limit * 6 // 10) // chunk * chunk
    child = subprocess.Popen(
        [sys.executable, "-m", "gpushare.probe", "--hold", str(hold), "--library", library],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(env),
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline().split()
        if len(line) != 2 or line[0] != "held":
            return Check(name, None, "the second process could not allocate", "memory")
        held = int(line[1])
        got, _stopped, pointers = _allocate_until_oom(driver, chunk, int(limit * ALLOC_CEILING))
        _free(driver, pointers)
        return judge_shared(name, held, got, limit)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=60)


def _child_float(args: list[str], env: Mapping[str, str]) -> float:
    result = subprocess.run(
        [sys.executable, "-m", "gpushare.probe", *args],
        capture_output=True,
        text=True,
        env=dict(env),
        timeout=120,
    )
    try:
        return float(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0.0


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(1 << 20)
    except OSError:
        return ""


# -- the report ----------------------------------------------------------------------------


def verdict(checks: Sequence[Check]) -> tuple[bool, list[str]]:
    """(every limit holds, the names of the checks that failed)."""
    failed = [c.name for c in checks if c.ok is False]
    return not failed, failed


def render(checks: Sequence[Check]) -> str:
    lines = []
    for check in checks:
        mark = "GAP " if check.gap else {True: "ok  ", False: "FAIL", None: "--  "}[check.ok]
        lines.append(f"{mark} {check.name}: {check.detail}")
    ok, failed = verdict(checks)
    lines.append(
        "VERDICT: every limit checked is enforced"
        if ok
        else f"VERDICT: NOT ENFORCED: {', '.join(failed)}"
    )
    lines.append(REPORT_MARKER + json.dumps([asdict(c) for c in checks]))
    return "\n".join(lines) + "\n"


def _check(raw: Any) -> Check:
    ok = raw["ok"]
    return Check(
        str(raw["name"]),
        ok if ok is None or isinstance(ok, bool) else False,
        str(raw["detail"]),
        str(raw.get("limit", "")),
        raw.get("gap") is True and ok is None,
    )


def parse_report(log: str) -> list[Check] | None:
    """The checks from a probe's output (its last report line); None if there is none."""
    for line in reversed(log.splitlines()):
        if line.startswith(REPORT_MARKER):
            try:
                return [_check(c) for c in json.loads(line[len(REPORT_MARKER) :])]
            except (ValueError, TypeError, KeyError):
                return None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from gpushare.base.cli import Parser

    parser = Parser(prog="python -m gpushare.probe", description=__doc__)
    parser.add_argument("--hold", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--library", default="libcuda.so.1", help="the CUDA driver library")
    parser.add_argument(
        "--spin-seconds",
        type=float,
        default=SPIN_SECONDS,
        help="length of each compute run (default: %(default)s)",
    )
    parser.add_argument(
        "--spin-warmup",
        type=float,
        default=SPIN_WARMUP_SECONDS,
        help="seconds of launches before each compute run is counted (default: %(default)s)",
    )
    parser.add_argument(
        "--memory-backend",
        choices=("interposer", "driver"),
        default="interposer",
        help="what holds the memory limit: the interposer (read from the environment) "
        "or the driver (give --limit-mib)",
    )
    parser.add_argument("--limit-mib", type=int, help="the memory limit under the driver")
    args = parser.parse_args(argv)
    from gpushare.probe.cuda import CudaError, Driver

    try:
        if args.hold is not None:  # the second process: hold memory until stdin closes
            driver = Driver(args.library)
            _context(driver)
            pointer = ctypes.c_uint64()
            code = driver.try_call("cuMemAlloc_v2", ctypes.byref(pointer),
                                   ctypes.c_size_t(args.hold))  # fmt: skip
            print(f"held {args.hold if code == 0 else 0}", flush=True)
            sys.stdin.read()
            return 0
        if args.spin:  # the unthrottled baseline
            driver = Driver(args.library)
            _context(driver)
            print(spin_throughput(driver, args.spin_seconds, args.spin_warmup), flush=True)
            return 0
        checks = run(
            os.environ,
            args.library,
            args.spin_seconds,
            args.memory_backend,
            args.limit_mib,
            args.spin_warmup,
        )
    except (OSError, CudaError) as exc:
        print(f"probe: cannot run: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(checks))
    return 0 if verdict(checks)[0] else 1


if __name__ == "__main__":
    sys.exit(main())
