"""``python -m gpushare.bench.gpu``: read the machine, print the plan, and (unless
``--dry-run``) measure every present backend, writing ``gpu-bench.json`` (the facts, the
plan, every measurement) and ``gpu-bench.md`` (the report) into ``--out``.

Fails soft per backend: one that cannot be set up, or whose steps fail, is reported with
the reason and the others still run; steps past ``--deadline`` are skipped, and said to
be. Exit status: 0 when every present backend's steps ran, 1 when some failed or were
skipped, 2 when nothing could run (no card).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from gpushare.base.cli import Parser
from gpushare.bench.gpu import facts as facts_mod
from gpushare.bench.gpu import plan as plan_mod
from gpushare.bench.gpu import table
from gpushare.bench.gpu.records import Measurement
from gpushare.bench.gpu.scenarios import Kernel, measure
from gpushare.bench.gpu.tenants import Context, Tenancy, TenancyError, tenancy


def _header(facts: facts_mod.Facts, plan: plan_mod.Plan, began: datetime) -> list[str]:
    card = plan.card
    lines = [f"## {began:%Y-%m-%d %H:%M} UTC: make gpu-bench"]
    if card:
        lines += ["", f"**Machine.** {card.name} ({card.memory_mib} MiB, MIG {card.mig}, "
                  f"persistence {card.persistence}, compute mode {card.compute_mode}), driver "
                  f"{card.driver}, kernel {facts.kernel}, /sys/fs/cgroup "
                  f"{facts.cgroup_fs or 'absent'}, driver memory limits "
                  f"{facts.limits_backend or 'none'}"
                  + (f" (dmem.capacity: {facts.dmem_capacity})" if facts.dmem_capacity else "")
                  + f". Kernel: {plan.settings.blocks} blocks of {plan.settings.threads} "
                  f"threads, {plan.settings.iters} dependent FMAs each, {plan.settings.batch} "
                  "launches per synchronisation."]  # fmt: skip
    return lines


#: Called after each step with its measurement and how long it took.
StepDone = Callable[[Measurement, float], None]


def execute(plan: plan_mod.Plan, context: Context, library: str, deadline: float,
            log: StepDone) -> tuple[list[Measurement], list[str]]:  # fmt: skip
    """Every step of the plan, backend by backend (each set up once, undone after); the
    measurements and the notes (setup, teardown, skips)."""
    kernel = Kernel(library, plan.settings)
    measurements: list[Measurement] = []
    notes: list[str] = []
    order = ["none", *(b.name for b in plan.present)]
    by_name = {b.name: b for b in plan.backends}
    for name in order:
        steps = [s for s in plan.steps if s.backend == name and s.scenario != "control"]
        measurements += _backend_steps(by_name.get(name), steps, context, kernel, deadline,
                                       notes, log)  # fmt: skip
    control = [s for s in plan.steps if s.scenario == "control"]
    measurements += _backend_steps(None, control, context, kernel, deadline, notes, log)
    return measurements, notes


def _backend_steps(backend: plan_mod.Backend | None, steps: Sequence[plan_mod.Step],
                   context: Context, kernel: Kernel, deadline: float, notes: list[str],
                   log: StepDone) -> list[Measurement]:  # fmt: skip
    name = backend.name if backend else "none"
    done: list[Measurement] = []
    if not steps:
        return done
    if time.monotonic() > deadline:
        notes.append(f"{name}: skipped, past the deadline ({len(steps)} steps)")
        return [Measurement(s.scenario, s.backend, s.run, (), error="skipped: past the deadline")
                for s in steps]  # fmt: skip
    made: Tenancy | None = None
    try:
        with tenancy(backend, context) as made:
            for step in steps:
                if time.monotonic() > deadline:
                    done.append(Measurement(step.scenario, step.backend, step.run, (),
                                            error="skipped: past the deadline"))  # fmt: skip
                    continue
                began = time.monotonic()
                try:
                    m = measure(made, step, kernel, context.share_mib)
                except Exception as exc:  # one step's failure is reported, not fatal
                    m = Measurement(step.scenario, step.backend, step.run, (), error=repr(exc))
                done.append(m)
                log(m, time.monotonic() - began)
    except TenancyError as exc:
        notes.append(f"{name}: cannot be set up: {exc}")
        print(f"gpu-bench: {name}: cannot be set up: {exc}", flush=True)
        done += [Measurement(s.scenario, s.backend, s.run, (), error=f"setup: {exc}")
                 for s in steps if not any(m.scenario == s.scenario and m.run == s.run
                                           for m in done)]  # fmt: skip
    if made is not None:  # after the with: what its undoing said too
        notes += [f"{name}: {n}" for n in made.notes]
    return done


def _brief(m: Measurement) -> str:
    if m.error:
        return f"FAILED {m.error}"
    parts = []
    for t in m.tenants[:3]:
        stage = "first_kernel" if "first_kernel" in t.stages else "main"
        what = f"{t.rate:.1f}/s" if t.rate else f"{stage} at {t.stages.get(stage, 0.0):.2f} s"
        if t.asked_mib:
            what += f", {t.allocated_mib}/{t.asked_mib} MiB"
        parts.append(f"{t.role} {what}" + (f" ERROR {t.error}" if t.error else ""))
    more = f" (+{len(m.tenants) - 3})" if len(m.tenants) > 3 else ""
    return "; ".join(parts) + more


def report(results: dict[str, Any]) -> str:
    """The markdown report from a results file's contents."""
    plan = results["plan"]
    backends = [plan_mod.Backend(**b) for b in plan["backends"]]
    measurements = [Measurement.from_json(m) for m in results["measurements"]]
    settings = plan["settings"]
    header = list(results.get("header", []))
    notes = results.get("notes", [])
    text = table.build(header, backends, measurements, share=settings["share"],
                       share_mib=plan["share_mib"], crowd=settings["crowd"])  # fmt: skip
    if notes:
        text += "\n### Notes\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    return text


def _parser() -> Parser:
    p = Parser(prog="python -m gpushare.bench.gpu", description=__doc__)
    p.add_argument("--dry-run", action="store_true", help="the facts and the plan only")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-bench-out")
    p.add_argument("--interposer", default="build/gpu-proof/libvgpu.so")
    p.add_argument("--hook", default="build/gpu-proof/gpushare-memory-hook")
    p.add_argument("--library", default="libcuda.so.1", help="the CUDA driver library")
    p.add_argument("--backends", default=",".join(plan_mod.BACKENDS),
                   help="which to measure where present (default: all)")  # fmt: skip
    p.add_argument("--runs", type=int, default=plan_mod.Settings.runs)
    p.add_argument("--seconds", type=float, default=plan_mod.Settings.seconds)
    p.add_argument("--pressure-runs", type=int, default=plan_mod.Settings.pressure_runs)
    p.add_argument("--warmup", type=float, default=plan_mod.Settings.warmup)
    p.add_argument("--interposer-warmup", type=float,
                   default=plan_mod.Settings.interposer_warmup,
                   help="the interposer tenants' warm-up (HAMi-core's first burst)")  # fmt: skip
    p.add_argument("--crowd", type=int, default=plan_mod.Settings.crowd)
    p.add_argument("--deadline", type=float, default=plan_mod.BUDGET_S,
                   help="seconds after which the remaining steps are skipped")  # fmt: skip
    p.add_argument("--table", metavar="RESULTS_JSON", help="rebuild the report from a results file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.table:
        sys.stdout.write(report(json.loads(Path(args.table).read_text())))
        return 0
    began = datetime.now(UTC)
    facts = facts_mod.gather(args.interposer, args.hook)
    settings = plan_mod.Settings(
        runs=args.runs,
        pressure_runs=args.pressure_runs,
        seconds=args.seconds,
        warmup=args.warmup,
        interposer_warmup=args.interposer_warmup,
        crowd=args.crowd,
    )
    plan = plan_mod.decide(facts, settings)
    wanted = set(args.backends.split(","))
    plan = plan_mod.Plan(plan.card, plan.share_mib,
                         tuple(b if b.name in wanted or not b.present else
                               plan_mod.Backend(b.name, b.memory, b.compute, False,
                                                "not asked for (--backends)")
                               for b in plan.backends),
                         tuple(s for s in plan.steps if s.backend in wanted | {"none"}),
                         plan.settings)  # fmt: skip
    print(plan_mod.render(plan, facts), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        print("gpu-bench: dry run: nothing run", flush=True)
        return 0
    if plan.card is None or not plan.present:
        print("gpu-bench: nothing to measure here", flush=True)
        return 2
    signal.signal(signal.SIGTERM, _exit_on_signal)  # the finally blocks stop MPS
    scratch = Path(tempfile.mkdtemp(prefix="gpushare-bench-"))
    context = Context(uuid=plan.card.uuid, share=settings.share, share_mib=plan.share_mib,
                      scratch=scratch, interposer=os.path.abspath(facts.interposer)
                      if facts.interposer else "", hook=os.path.abspath(facts.hook)
                      if facts.hook else "", limits_backend=facts.limits_backend,
                      mps_control=facts.mps_control)  # fmt: skip
    so_far: list[Measurement] = []

    def step_done(m: Measurement, seconds: float) -> None:
        so_far.append(m)  # saved as it goes (before it is said): a run cut short keeps it
        _save(out, _results(facts, plan, began, so_far, ["partial: the run did not finish"]))
        print(f"gpu-bench: {m.backend} {m.scenario} run {m.run}: {_brief(m)} ({seconds:.1f} s)",
              flush=True)  # fmt: skip

    try:
        with _nvml_held() as held:
            measurements, notes = execute(plan, context, args.library,
                                          time.monotonic() + args.deadline, step_done)  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # accounting files, MPS directories
    results = _results(facts, plan, began, measurements, [held, *notes])
    _save(out, results)
    text = report(results)
    (out / "gpu-bench.md").write_text(text)
    print(text, flush=True)
    return 0 if all(m.ok for m in measurements) else 1


def _results(
    facts: facts_mod.Facts,
    plan: plan_mod.Plan,
    began: datetime,
    measurements: Sequence[Measurement],
    notes: Sequence[str],
) -> dict[str, Any]:
    return {
        "began": began.isoformat(),
        "ended": datetime.now(UTC).isoformat(),
        "header": _header(facts, plan, began),
        "facts": facts.to_json(),
        "plan": plan.to_json(),
        "measurements": [m.to_json() for m in measurements],
        "notes": list(notes),
    }


def _save(out: Path, results: dict[str, Any]) -> None:
    tmp = out / "gpu-bench.json.tmp"
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(out / "gpu-bench.json")


@contextlib.contextmanager
def _nvml_held() -> Iterator[str]:
    """NVML open for the whole run, as gpushare's daemon holds it on every node: without a
    process holding the driver open (and no persistence mode) each first open of the
    device costs seconds, which would be counted in every tenant's start. Yields the
    note that says which it was."""
    held = False
    try:
        import pynvml

        pynvml.nvmlInit()
        held = True
        note = "NVML held open by the bench during the run, as the node's daemon holds it"
    except Exception as exc:  # pynvml missing, or NVML failing: measured as it is
        note = (f"NVML not held open during the run ({str(exc)[:200]}): each start "
                "includes the driver's first open")  # fmt: skip
    try:
        yield note
    finally:
        if held:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
