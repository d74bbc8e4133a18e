"""gpushare.bench.run: the phases run in order into one report; the message phase
measures in this process and meets the kubelet's message limit; --latency-only refuses
--write before measuring anything. (The whole quick run, as make bench runs it, is
tests/scenarios/test_bench_smoke.py's.)"""

from __future__ import annotations

import pytest

from gpushare.bench import run
from gpushare.bench.report import QUICK, Plan, Report


def test_phases_run_in_order_into_one_report() -> None:
    seen: list[str] = []

    def phase(name: str):  # type: ignore[no-untyped-def]
        def measure(plan: Plan, report: Report) -> None:
            seen.append(name)
            report.add(name, str(plan.cards), "")

        return measure

    report = run.run(QUICK, [phase("a"), phase("b")])
    assert seen == ["a", "b"] and [r.figure for r in report.rows] == ["a", "b"]


def test_the_message_phase_stays_within_the_kubelets_limit() -> None:
    report = Report()
    run.measure_messages(QUICK, report)
    serialised, largest = report.rows
    assert serialised.figure.startswith("ListAndWatch message serialised, 2 x H200")
    assert largest.figure.startswith("largest message, 16 x 192 GiB") and largest.ok is True


def test_latency_only_refuses_write(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        run.main(["--quick", "--latency-only", "--write", "/nonexistent/doc.md"])
    assert stop.value.code == 2 and "--latency-only" in capsys.readouterr().err
