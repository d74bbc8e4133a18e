"""The measurements, each over a :class:`~gpushare.bench.gpu.tenants.Tenancy`: a window
of steady kernels in one or two tenants started together, the same with one tenant past
its memory limit, and the time processes take to their first kernel.

Tenants are started together without sleeps: each worker prints ``ready`` once it has
its context, its memory and its first kernel behind it, and every window starts when
all of them have (a line on each one's stdin). A tenant that fails is a result with its
error, never an exception out of here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpushare.bench.gpu.plan import Settings, Step
from gpushare.bench.gpu.records import Measurement, TenantResult
from gpushare.bench.gpu.tenants import Running, Tenancy

#: Seconds a tenant may take beyond its window (start, allocations, a crowd's contention).
SLACK_S = 45.0


@dataclass(frozen=True)
class Kernel:
    """The worker's options that every scenario shares."""

    library: str
    settings: Settings

    def args(self, warmup: float) -> list[str]:
        s = self.settings
        return ["--library", self.library, "--blocks", str(s.blocks), "--threads",
                str(s.threads), "--iters", str(s.iters), "--batch", str(s.batch),
                "--warmup", repr(warmup), "--seconds", repr(s.seconds)]  # fmt: skip


def _finish(running: Running, deadline: float) -> TenantResult:
    """The tenant's result: its last JSON line once it ended (an interposer may log after
    it); where there is none, an error with its last lines. Notes (a failed hook, a kill)
    join the error."""
    lines = running.finish(deadline)
    last = next((x for x in reversed(lines) if x.startswith("{")), " | ".join(lines[-5:]))
    result = TenantResult.parse(last, running.role)
    if running.notes:
        result = replace(result, error="; ".join(filter(None, [result.error, *running.notes])))
    return result


def _go(tenants: Sequence[Running]) -> None:
    for running in tenants:
        if running.proc.poll() is None and running.proc.stdin is not None:
            with contextlib.suppress(OSError):
                running.proc.stdin.write("go\n")
                running.proc.stdin.flush()


def _release(tenancy: Tenancy, tenants: Sequence[Running]) -> None:
    for running in tenants:
        if running.proc.poll() is None:
            running.proc.kill()
            running.proc.wait()
        if running.proc.stdin is not None:
            with contextlib.suppress(OSError):
                running.proc.stdin.close()
        tenancy.release(running.name)


def window(tenancy: Tenancy, step: Step, kernel: Kernel, roles: Sequence[str]) -> Measurement:
    """``len(roles)`` tenants, their windows started together (dedicated, alone, pair,
    control)."""
    warmup = kernel.settings.warmup_for(step.backend)
    deadline = time.monotonic() + warmup + kernel.settings.seconds + SLACK_S
    names = [(f"{step.scenario}-{step.run}-{role}", role) for role in roles]
    tenants = tenancy.spawn_many(names, [*kernel.args(warmup), "--ready"])
    try:
        for running in tenants:
            running.wait_ready(deadline)
        _go(tenants)
        results = [_finish(t, deadline) for t in tenants]
    finally:
        _release(tenancy, tenants)
    return Measurement(step.scenario, step.backend, step.run, tuple(results),
                       _hooks(tenants))  # fmt: skip


def pressure(tenancy: Tenancy, step: Step, kernel: Kernel, share_mib: int) -> Measurement:
    """The aggressor asks for 1.5 x its share and spins; then the victim asks for 80 % of
    its own in steps; both windows together."""
    warmup = kernel.settings.warmup_for(step.backend)
    deadline = time.monotonic() + warmup + kernel.settings.seconds + 2 * SLACK_S
    args = [*kernel.args(warmup), "--ready"]
    tenants: list[Running] = []
    try:
        for role, ask in (("aggressor", share_mib * 3 // 2), ("victim", share_mib * 8 // 10)):
            name = f"{step.scenario}-{step.run}-{role}"
            tenants += tenancy.spawn_many([(name, role)], [*args, "--alloc-mib", str(ask)])
            tenants[-1].wait_ready(deadline)  # the aggressor holds its memory from here
        _go(tenants)
        results = [_finish(t, deadline) for t in tenants]
    finally:
        _release(tenancy, tenants)
    return Measurement(step.scenario, step.backend, step.run, tuple(results), _hooks(tenants))


def start(tenancy: Tenancy, step: Step, kernel: Kernel) -> Measurement:
    """``step.tenants`` processes started at once, each to its first kernel."""
    deadline = time.monotonic() + SLACK_S
    names = [(f"start-{step.run}-{i}", f"t{i}") for i in range(step.tenants)]
    tenants = tenancy.spawn_many(names, [*kernel.args(0.0), "--start-only"])
    try:
        results = [_finish(t, deadline) for t in tenants]
    finally:
        _release(tenancy, tenants)
    return Measurement(step.scenario, step.backend, step.run, tuple(results), _hooks(tenants))


def python_only(tenancy: Tenancy, step: Step) -> Measurement:
    """The interpreter's own start, for the start table's baseline."""
    tenants = tenancy.spawn_many([("python-0", "t0")], ["--no-cuda"])
    results = [_finish(t, time.monotonic() + SLACK_S) for t in tenants]
    _release(tenancy, tenants)
    return Measurement(step.scenario, step.backend, step.run, tuple(results))


def _hooks(tenants: Sequence[Running]) -> tuple[float, ...]:
    return tuple(t.hook_seconds for t in tenants if t.hook_seconds is not None)


def measure(tenancy: Tenancy, step: Step, kernel: Kernel, share_mib: int) -> Measurement:
    """The step, whatever its scenario."""
    if step.scenario in ("dedicated", "control", "alone"):
        return window(tenancy, step, kernel, ["a"])
    if step.scenario == "pair":
        return window(tenancy, step, kernel, ["a", "b"])
    if step.scenario == "pressure":
        return pressure(tenancy, step, kernel, share_mib)
    if step.scenario == "start":
        return start(tenancy, step, kernel)
    if step.scenario == "python":
        return python_only(tenancy, step)
    raise ValueError(f"unknown scenario {step.scenario}")
