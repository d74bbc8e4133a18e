"""Issue 33.5: the daemon's and the extender's ``/metrics`` keep Prometheus' naming rules.

The daemon runs on a simulated node with shared containers admitted (every per-card and
per-container family present) and is scraped over HTTP; the output is linted by
tests/kit/promlint.py (what ``promtool check metrics`` checks). The gauges renamed in 0.2 are
also served under their old names, marked deprecated, with the same samples. The DRA
families are linted where a DRA card serves them (tests/scenarios/test_dra_shares_shown.py).
"""

from __future__ import annotations

from conftest import TESLA_P4, Node, cards
from kit import promlint
from kit.procs import free_port, scrape
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpushare.extender.extendermetrics import ExtenderMetrics
from gpushare.ops.daemonmetrics import RENAMED

BAD = """\
# HELP app_requests Requests.
# TYPE app_requests counter
app_requests 3
# TYPE app_memory_total gauge
app_memory_total 1
# HELP app_latency_ms Latency.
# TYPE app_latency_ms gauge
app_latency_ms 1
# HELP app_bytes_used Used.
# TYPE app_bytes_used gauge
app_bytes_used{a="1"} 1
app_bytes_used{a="1"} 2
# HELP app_size_kilobytes Size.
# TYPE app_size_kilobytes gauge
app_size_kilobytes 1
"""


def test_the_lint_finds_what_promtool_finds() -> None:
    """The check can fail: each rule on a family that breaks it."""
    found = promlint.problems(BAD)
    expected = [
        "app_requests: a counter's name ends in _total",
        "app_memory_total: no HELP",
        "app_memory_total: a gauge must not end in _total (only counters do)",
        "app_latency_ms: spell the unit out, not 'ms'",
        "app_bytes_used: the unit (bytes) is the name's suffix",
        "app_bytes_used{'a': '1'}: the same series twice",
        "app_size_kilobytes: use the base unit bytes, not kilobytes",
    ]
    assert sorted(found) == sorted(expected)
    assert promlint.problems("# HELP a_total x\n# TYPE a_total counter\na_total 1\n") == []


def test_the_daemons_metrics_pass_the_lint(node: Node) -> None:
    port = free_port()
    node.start(cards(TESLA_P4, 2), metrics_port=port, metrics_address="127.0.0.1")
    node.kubelet.admit("a", "main", {node.memory: 4, node.core: 10})
    node.kubelet.admit("b", "main", {node.memory: 8})
    assert node.daemon is not None and node.daemon.core.refresher is not None
    assert node.daemon.core.refresher.refresh_once()
    status, text = scrape(port)
    assert status == 200
    assert promlint.problems(text, deprecated=RENAMED.values()) == []
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "gpushare_container_memory_bytes" in families  # the per-container series linted
    for new, old in RENAMED.items():
        if new.startswith("gpushare_dra_"):
            continue  # no DRA card here: tests/scenarios/test_dra_shares_shown.py
        assert families[old].documentation.startswith(f"DEPRECATED: use {new} ")
        assert [(s.labels, s.value) for s in families[old].samples] == [
            (s.labels, s.value) for s in families[new].samples
        ]
        assert families[new].samples and not families[new].documentation.startswith("DEPR")


def test_the_extenders_metrics_pass_the_lint() -> None:
    metrics = ExtenderMetrics(lambda: 1, lambda: 2, lambda: 3)
    metrics.requests.labels("filter", "200").inc()
    metrics.latency.labels("filter").observe(0.01)
    metrics.verdicts.labels("fits").inc()
    metrics.bindings.labels("bound").inc()
    text = generate_latest(metrics.registry).decode()
    assert "gpushare_extender_requests_total" in text
    assert promlint.problems(text) == []
