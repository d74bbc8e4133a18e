"""``python -m gpushare.bench.gpu`` (``bench/gpu/run.py``) without a GPU: its arguments,
what it does where nothing can be measured, the steps past the deadline, the one-line
summary of a step, the results file and the report rebuilt from it.

What it proves: the options' defaults are the plan's settings (``--out`` from ``$OUT``);
``--backends`` leaves the backends not asked for absent, with the reason, and takes
their steps out of the plan; a machine without a card exits 2 (``--dry-run``: 0), and
writes no results; every step past the deadline is a measurement that says so, set up
nothing and is noted per backend; the results file is replaced whole and the report is
rebuilt from it alone (``--table``), with the notes last; a SIGTERM unwinds as an exit.
The bench run whole on stand-ins is ``test_gpu_bench_standin.py``.
"""

from __future__ import annotations

import json
import signal
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kit.mps import install_standin

from gpushare.bench.gpu import facts as f
from gpushare.bench.gpu import plan as p
from gpushare.bench.gpu import run, table
from gpushare.bench.gpu.records import Measurement, TenantResult
from gpushare.bench.gpu.tenants import Context

UUID = "GPU-1081cd7b-52eb-fd89-c0b1-ba91b23923dd"
SMI_LINE = f"0, {UUID}, NVIDIA H200, 580.159.04, 4096, Disabled, Enabled, Default, 00000000:19:00.0"
BEGAN = datetime(2026, 12, 1, 5, 30, tzinfo=UTC)


def facts() -> f.Facts:
    """A card and an MPS control daemon: time-sliced and mps present."""
    return f.Facts(
        cards=f.parse_smi(SMI_LINE + "\n"),
        kernel="6.8.0",
        cgroup_fs="cgroup2fs",
        mps_control="/usr/bin/nvidia-cuda-mps-control",
        mps_help="  -M,--multiuser-server    Enable multi-user mode",
    )


def machine(where: Path, *, card: bool) -> Path:
    """A PATH of stand-ins only: an MPS control daemon, and with ``card`` an nvidia-smi
    that prints one recorded card."""
    bin_dir = where / "bin"
    install_standin(bin_dir)
    if card:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f'#!/bin/sh\necho "{SMI_LINE}"\n')
        smi.chmod(0o755)
    return bin_dir


# -- the arguments ------------------------------------------------------------------------


def test_the_defaults_are_the_plans_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUT", raising=False)
    args = run._parser().parse_args([])
    settings = p.Settings()
    assert (args.runs, args.seconds, args.pressure_runs, args.warmup) == (
        settings.runs, settings.seconds, settings.pressure_runs, settings.warmup,
    )  # fmt: skip
    assert (args.interposer_warmup, args.crowd) == (settings.interposer_warmup, settings.crowd)
    assert args.deadline == p.BUDGET_S and args.backends.split(",") == list(p.BACKENDS)
    assert (args.out, args.dry_run, args.table) == ("gpu-bench-out", False, None)
    monkeypatch.setenv("OUT", "/somewhere/out")  # the device call's output folder
    assert run._parser().parse_args([]).out == "/somewhere/out"


def test_a_misspelt_option_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        run.main(["--run", "2"])  # an abbreviation of --runs is not taken for it
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--run" in err


def test_no_card_exits_2_and_a_dry_run_0_writing_no_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(machine(tmp_path, card=False)))
    out = tmp_path / "out"
    common = ["--out", str(out), "--interposer", str(tmp_path / "none")]
    assert run.main([*common, "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "card: none (no nvidia-smi on PATH)" in said
    assert said.rstrip().endswith("gpu-bench: dry run: nothing run")
    assert run.main(common) == 2
    assert capsys.readouterr().out.rstrip().endswith("gpu-bench: nothing to measure here")
    assert out.is_dir() and list(out.iterdir()) == []


def test_backends_not_asked_for_are_absent_with_the_reason_and_have_no_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(machine(tmp_path, card=True)))
    common = ["--out", str(tmp_path / "out"), "--interposer", str(tmp_path / "none"),
              "--runs", "2", "--pressure-runs", "1", "--dry-run"]  # fmt: skip
    assert run.main(common) == 0
    every = capsys.readouterr().out
    assert f"card: NVIDIA H200 ({UUID})" in every
    assert "backend mps: present" in every
    assert run.main([*common, "--backends", "time-sliced"]) == 0
    asked = capsys.readouterr().out
    assert "backend mps: absent: not asked for (--backends)" in asked
    # dedicated 2, python 1, time-sliced (alone 1, pair 2, pressure 1, start 2), control 1
    assert "backend time-sliced: present; memory nothing, compute time-slicing; 6 steps" in asked
    assert "steps: 10, " in asked


# -- past the deadline -------------------------------------------------------------------


def test_every_step_past_the_deadline_is_skipped_and_said_to_be(tmp_path: Path) -> None:
    plan = p.decide(facts(), p.Settings(runs=2))
    assert [b.name for b in plan.present] == ["time-sliced", "mps"]
    context = Context(UUID, 50, plan.share_mib, tmp_path)
    logged: list[Measurement] = []
    measurements, notes = run.execute(plan, context, "libcuda.so.1", float("-inf"),
                                      lambda m, _s: logged.append(m))  # fmt: skip
    assert logged == []  # nothing ran
    assert all(m.error == "skipped: past the deadline" and not m.tenants for m in measurements)
    measured = [(m.scenario, m.backend, m.run) for m in measurements]
    assert sorted(measured) == sorted((s.scenario, s.backend, s.run) for s in plan.steps)
    # the card's own figures first, then each present backend's, the control run last
    order = ["none", "time-sliced", "mps"]
    backends = [b for _s, b, _r in measured[:-1]]
    assert backends == sorted(backends, key=order.index)
    assert measured[-1] == ("control", "none", 0)
    count = {name: sum(1 for s in plan.steps if s.backend == name and s.scenario != "control")
             for name in order}  # fmt: skip
    assert notes == [
        *(f"{name}: skipped, past the deadline ({n} steps)" for name, n in count.items()),
        "none: skipped, past the deadline (1 steps)",  # the control run
    ]
    assert list(tmp_path.iterdir()) == []  # no tenancy was set up


# -- a step's line, the results and the report -----------------------------------------

tenant_results = st.builds(
    TenantResult,
    rate=st.sampled_from([0.0, 12.34]),
    asked_mib=st.sampled_from([0, 1638]),
    allocated_mib=st.sampled_from([0, 512]),
    stages=st.sampled_from([{}, {"main": 0.1}, {"main": 0.1, "first_kernel": 2.5}]),
    error=st.sampled_from(["", "CUDA_ERROR_OUT_OF_MEMORY"]),
    role=st.sampled_from(["a", "b", "victim"]),
)


@given(st.lists(tenant_results, max_size=6), st.sampled_from(["", "setup: no MPS"]))
def test_a_steps_line_names_at_most_three_tenants_or_its_failure(
    tenants: list[TenantResult], error: str
) -> None:
    line = run._brief(Measurement("pair", "mps", 0, tuple(tenants), error=error))
    assert "\n" not in line
    if error:
        assert line == f"FAILED {error}"
        return
    parts = line.split("; ")
    shown = tenants[:3]
    assert len([x for x in parts if x]) == len(shown)
    for part, t in zip(parts, shown, strict=False):
        assert part.startswith(f"{t.role} ")
        assert (f"{t.rate:.1f}/s" in part) == bool(t.rate)
        assert (f"{t.allocated_mib}/{t.asked_mib} MiB" in part) == bool(t.asked_mib)
        assert ("ERROR " + t.error in part) == bool(t.error)
    assert line.endswith(f" (+{len(tenants) - 3})") == (len(tenants) > 3)


def results(notes: list[str]) -> dict:
    plan = p.decide(facts(), p.Settings(runs=1))
    measured = [Measurement(s.scenario, s.backend, s.run,
                            (TenantResult(rate=100.0, stages={"main": 0.1}, role="a"),))
                for s in plan.steps]  # fmt: skip
    return run._results(facts(), plan, BEGAN, measured, notes)


def test_the_report_is_rebuilt_from_the_results_alone_with_the_notes_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = results(["NVML held open", "mps: MPS control daemon stopped"])
    run._save(tmp_path, saved)
    assert [x.name for x in tmp_path.iterdir()] == ["gpu-bench.json"]  # no .tmp left
    assert run.main(["--table", str(tmp_path / "gpu-bench.json")]) == 0
    text = capsys.readouterr().out
    assert text == run.report(json.loads(json.dumps(saved)))
    assert text.startswith("## 2026-12-01 05:30 UTC: make gpu-bench")
    assert "**Machine.** NVIDIA H200 (4096 MiB" in text and "kernel 6.8.0" in text
    assert text.endswith("### Notes\n\n- NVML held open\n- mps: MPS control daemon stopped\n")
    plan = saved["plan"]
    without = run.report(results([]))
    assert "### Notes" not in without
    assert without == table.build(
        results([])["header"], [p.Backend(**b) for b in plan["backends"]],
        [Measurement.from_json(m) for m in saved["measurements"]],
        share=plan["settings"]["share"], share_mib=plan["share_mib"],
        crowd=plan["settings"]["crowd"],
    )  # fmt: skip


def test_the_results_file_is_replaced_whole(tmp_path: Path) -> None:
    run._save(tmp_path, results(["partial: the run did not finish"]))
    run._save(tmp_path, results([]))
    again = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert again["notes"] == [] and again["began"] == BEGAN.isoformat()
    assert {"facts", "plan", "measurements", "header", "ended"} <= set(again)


def test_the_header_without_a_card_is_its_title_only() -> None:
    plan = p.decide(f.Facts(smi_error="no nvidia-smi on PATH"))
    assert run._header(f.Facts(), plan, BEGAN) == ["## 2026-12-01 05:30 UTC: make gpu-bench"]


def test_a_sigterm_unwinds_as_an_exit() -> None:
    with pytest.raises(SystemExit) as exit_:
        run._exit_on_signal(signal.SIGTERM, None)
    assert exit_.value.code == 128 + signal.SIGTERM


def test_nvml_held_or_not_says_which_in_one_line() -> None:
    with run._nvml_held() as note:
        assert "\n" not in note
        assert note.startswith(("NVML held open by the bench", "NVML not held open during"))
