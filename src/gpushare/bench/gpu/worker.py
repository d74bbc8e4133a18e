"""One tenant of the GPU benchmark: ``python -m gpushare.bench.gpu.worker``.

The enforcement probe's kind of steady kernel (:data:`gpushare.probe.cuda.SPIN_PTX`,
hand-written PTX the driver compiles) through the CUDA driver API by ctypes, nothing
else: no toolkit, no framework, no weights. In order, each stage timed in seconds from
``--t0`` (the parent's ``time.monotonic()`` just before it spawned this process; the
clock is the machine's, shared by every process):

1. ``main``: the interpreter reached this module;
2. ``gate`` (with ``--gate``): a line on stdin released it (the parent has put it in its
   cgroup and set its limit, as a container runtime's hook does before the workload);
3. ``init``, ``context``, ``module``: ``cuInit``, the context, the kernel's module;
4. ``--alloc-mib``: that much device memory in ``--chunk-mib`` steps (what it got and the
   first refusal are reported; it keeps what it got until it exits);
5. ``first_kernel``: one launch, synchronised (``--start-only`` stops here);
6. with ``--ready``: prints ``ready`` and waits for a line on stdin (the parent starts
   every tenant's window at once);
7. ``--warmup`` seconds of launches, then ``--seconds`` counted: kernels per second.

The last line of stdout is one JSON object (:class:`gpushare.bench.gpu.records.
TenantResult`); a CUDA failure is in its ``error``, never a traceback alone.
"""

from __future__ import annotations

import time

_MAIN = time.monotonic()  # before anything else is imported

import argparse  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

MIB = 1 << 20


class Kernel:
    """The steady kernel, loaded: ``run(n)`` launches it ``n`` times and synchronises."""

    def __init__(self, driver: Any, blocks: int, threads: int, iters: int) -> None:
        from gpushare.probe.cuda import SPIN_PTX

        self.driver, self.blocks, self.threads = driver, blocks, threads
        self.module = ctypes.c_void_p()
        driver.call("cuModuleLoadData", ctypes.byref(self.module), ctypes.c_char_p(SPIN_PTX))
        self.function = ctypes.c_void_p()
        driver.call("cuModuleGetFunction", ctypes.byref(self.function), self.module, b"spin")
        self.out = ctypes.c_uint64()
        driver.call("cuMemAlloc_v2", ctypes.byref(self.out),
                    ctypes.c_size_t(blocks * threads * 4))  # fmt: skip
        self._out = ctypes.c_uint64(self.out.value)
        self._iters = ctypes.c_uint32(iters)
        self.params = (ctypes.c_void_p * 2)(
            ctypes.cast(ctypes.byref(self._out), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(self._iters), ctypes.c_void_p),
        )

    def run(self, n: int) -> None:
        for _ in range(n):
            self.driver.call("cuLaunchKernel", self.function, self.blocks, 1, 1,
                             self.threads, 1, 1, 0, None, self.params, None)  # fmt: skip
        self.driver.call("cuCtxSynchronize")


def allocate(driver: Any, total_mib: int, chunk_mib: int) -> tuple[int, str, list[int]]:
    """Up to ``total_mib`` in ``chunk_mib`` steps: (MiB got, the first refusal's name or
    "", the pointers). Stops at the first refusal."""
    from gpushare.probe.cuda import CUDA_SUCCESS

    got, pointers = 0, list[int]()
    while got < total_mib:
        step = min(chunk_mib, total_mib - got)
        pointer = ctypes.c_uint64()
        code = driver.try_call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(step * MIB))
        if code != CUDA_SUCCESS:
            return got, driver.error_name(code), pointers
        pointers.append(pointer.value)
        got += step
    return got, "", pointers


def window(kernel: Kernel, warmup: float, seconds: float, batch: int) -> float:
    """Kernels per second over ``seconds``, counted after ``warmup`` seconds of the same."""
    until = time.monotonic() + warmup
    while time.monotonic() < until:
        kernel.run(batch)
    done = 0
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        kernel.run(batch)
        done += batch
    return done / (time.monotonic() - began)


def measure(args: argparse.Namespace, stages: dict[str, float], result: dict[str, Any]) -> None:
    from gpushare.probe.cuda import Driver

    def mark(stage: str) -> None:
        stages[stage] = time.monotonic() - args.t0

    if args.gate:
        sys.stdin.readline()
        mark("gate")
    driver = Driver(args.library)
    driver.call("cuInit", 0)
    mark("init")
    device = ctypes.c_int()
    driver.call("cuDeviceGet", ctypes.byref(device), 0)
    context = ctypes.c_void_p()
    driver.call("cuCtxCreate_v2", ctypes.byref(context), 0, device)
    mark("context")
    kernel = Kernel(driver, args.blocks, args.threads, args.iters)
    mark("module")
    if args.alloc_mib:
        got, refused, _held = allocate(driver, args.alloc_mib, args.chunk_mib)
        result.update(asked_mib=args.alloc_mib, allocated_mib=got, alloc_error=refused)
    kernel.run(1)
    mark("first_kernel")
    if args.start_only:
        return
    if args.ready:
        print("ready", flush=True)
        sys.stdin.readline()
    result["rate"] = window(kernel, args.warmup, args.seconds, args.batch)


def main(argv: Sequence[str] | None = None) -> int:
    from gpushare.base.cli import Parser

    parser = Parser(prog="python -m gpushare.bench.gpu.worker",
                                     description=__doc__)  # fmt: skip
    parser.add_argument("--library", default="libcuda.so.1")
    parser.add_argument(
        "--t0", type=float, default=_MAIN, help="the parent's monotonic clock at spawn"
    )
    parser.add_argument("--gate", action="store_true", help="wait for a line before cuInit")
    parser.add_argument("--ready", action="store_true", help="print ready, wait for a line")
    parser.add_argument("--start-only", action="store_true", help="stop after the first kernel")
    parser.add_argument(
        "--no-cuda", action="store_true", help="report the interpreter's start only"
    )
    parser.add_argument("--alloc-mib", type=int, default=0)
    parser.add_argument("--chunk-mib", type=int, default=256)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    stages = {"main": _MAIN - args.t0}
    result: dict[str, Any] = {"stages": stages}
    if not args.no_cuda:
        from gpushare.probe.cuda import CudaError

        try:
            measure(args, stages, result)
        except (OSError, CudaError) as exc:
            result["error"] = str(exc)[:500]
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
