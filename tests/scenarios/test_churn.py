"""The churn scenario (``make churn``) runs: pods that end free room that waiting pods
then get, with the real daemon, kubelet stand-in, API double and extender; no
admission is refused and no card overcommitted. (Its timings go to
docs/benchmarks.md; a test asserts none.)"""

from __future__ import annotations

from gpushare.sim import churn


def test_one_round_of_churn_binds_every_waiting_pod_without_a_refusal() -> None:
    results = churn.run(rounds=1, watch_pods=True, delete=3)
    assert len(results.bind) == len(results.admit) == 3
    assert results.refused_admissions == 0
    assert results.overcommitted == 0
