"""``make scale`` (gpushare.bench.scale) at toy size: its figures come from a real
extender process answering by names, and its start reads one list."""

from __future__ import annotations

from pathlib import Path

from gpushare.bench import scale


def test_the_scheduler_sends_its_default_share_of_nodes() -> None:
    assert scale.scheduler_sends(50) == 50
    assert scale.scheduler_sends(100) == 100
    assert scale.scheduler_sends(1000) == 420
    assert scale.scheduler_sends(5000) == 500
    assert scale.scheduler_sends(20000) == 1000


def test_a_toy_run_measures_both_ways_and_one_list(tmp_path: Path) -> None:
    by_names = scale.measure_verbs(nodes=6, requests=2, full_nodes=False)
    full = scale.measure_verbs(nodes=6, requests=2, full_nodes=True)
    for row in (by_names, full):
        assert row["filter"]["status"] == [200]
        assert row["prioritize"]["status"] == [200]
    assert by_names["body_kb"] < full["body_kb"] / 10
    start = scale.measure_start(pods=1200, nodes=3)  # three pages
    assert start["pod_lists"] == 1
    assert start["rss_mb"] > 0
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Scale (`make scale`)\n\nold\n\n## Other\n\nkept\n")
    scale._write_section(docs, "\n".join(scale.table([by_names, full], [start])) + "\n")
    text = docs.read_text()
    assert "old" not in text and "kept" in text and "| 6 | 6 names |" in text
