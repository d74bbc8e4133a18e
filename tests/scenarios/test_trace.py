"""The trace simulation drives the real daemon: every admission goes through the
binder behind the kubelet stand-in, and every failure is reported with its reason."""

from __future__ import annotations

from pathlib import Path

from gpushare.sim.trace import main, run


def test_the_extender_removes_the_admission_failures_that_node_totals_cause() -> None:
    results, report = run(pods=150, seed=3, load=1.0)
    by_run = {(r.placement, r.extender): r for r in results}
    for r in results:
        assert r.admitted + r.unschedulable + r.admission_failures == r.pods == 150
        assert len(r.failure_reasons) == r.admission_failures
    with_extender, without = by_run[("binpack", True)], by_run[("binpack", False)]
    assert without.admission_failures >= 20  # totals say yes, no single card has room
    # What remains are the daemon's own refusals (docs/multi-card.md, "Known limits").
    assert with_extender.admission_failures < without.admission_failures / 4
    for r in results:
        if r.extender:
            for reason in r.failure_reasons[:3]:
                assert reason in report
    assert "| binpack | no | " in report and "| spread | yes | " in report


def test_main_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "trace.md"
    code = main(["--pods", "60", "--seed", "3", "--write", str(out)])
    text = out.read_text()
    assert text.startswith("Trace: 60 pods, seed 3")
    failures = text.count("\n- ")
    assert code == (1 if failures else 0)
