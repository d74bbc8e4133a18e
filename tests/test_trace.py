"""The trace simulation: the extender removes admission failures; the run is deterministic."""

from __future__ import annotations

from pathlib import Path

from gpushare.sim.trace import main, run


def test_extender_removes_admission_failures_that_node_totals_cause() -> None:
    results, report = run(pods=600, seed=3, load=1.0)
    by_run = {(r.placement, r.extender): r for r in results}
    for placement in ("binpack", "spread"):
        with_extender, without = by_run[(placement, True)], by_run[(placement, False)]
        assert with_extender.admission_failures == 0
        assert without.admission_failures > 0
        for r in (with_extender, without):
            assert r.admitted + r.unschedulable + r.admission_failures == r.pods == 600
    assert report == run(pods=600, seed=3, load=1.0)[1]  # same seed, same report
    assert "| binpack | yes | 600 (100.0 %) | 0 | 0 |" in report


def test_main_writes_the_report_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "trace.md"
    assert main(["--pods", "300", "--seed", "3", "--write", str(out)]) == 0
    assert out.read_text().startswith("Trace: 300 pods, seed 3")
