"""``make scale`` (gpushare.bench.scale) at toy size against its stand-in list server:
its figures come from a real extender process answering by names, and its start reads
one list. The same path against the real kube-apiserver is tests/e2e/test_scale_real.py."""

from __future__ import annotations

from pathlib import Path

from gpushare.bench import scale
from gpushare.bench.scalestandin import ListStandIn


def test_the_scheduler_sends_its_default_share_of_nodes() -> None:
    assert scale.scheduler_sends(50) == 50
    assert scale.scheduler_sends(100) == 100
    assert scale.scheduler_sends(1000) == 420
    assert scale.scheduler_sends(5000) == 500
    assert scale.scheduler_sends(20000) == 1000


def test_a_toy_run_measures_both_ways_and_one_list(tmp_path: Path) -> None:
    stand_in = ListStandIn(6, pods=0)
    api = scale.ApiTarget(stand_in.start())
    try:
        by_names = scale.measure_verbs(api, tmp_path, nodes=6, requests=2, full_nodes=False)
        full = scale.measure_verbs(api, tmp_path, nodes=6, requests=2, full_nodes=True)
    finally:
        stand_in.stop()
    for row in (by_names, full):
        assert row["filter"]["status"] == [200]
        assert row["prioritize"]["status"] == [200]
        assert row["kept"] == [6]  # every node has room for the pod
    assert by_names["body_kb"] < full["body_kb"] / 10
    stand_in = ListStandIn(3, 1200, prerender=True)  # three pages
    try:
        start = scale.measure_start(scale.ApiTarget(stand_in.start()), tmp_path, 1200)
    finally:
        stand_in.stop()
    assert start["pod_lists"] == 1 == stand_in.lists["pods"]
    assert start["rss_mb"] > 0
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Scale (`make scale`)\n\nold\n\n## Other\n\nkept\n")
    results = scale.Results("the stand-in", [by_names, full], [start])
    scale._write_section(docs, "\n".join(scale.table(results)) + "\n")
    text = docs.read_text()
    assert "old" not in text and "kept" in text and "| 6 | 6 names |" in text
    assert "API server: the stand-in" in text
