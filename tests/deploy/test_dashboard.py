"""Every query of the shipped Grafana dashboard names a metric the daemon exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from conftest import TESLA_P4, Node, cards
from kit.procs import free_port, scrape
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "gpushare.json"
#: Series Prometheus derives from a family: histogram parts, the counter's ``_total``.
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def queries(dashboard: dict[str, Any]) -> list[str]:
    found = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            found.append(query["query"])
    return found


def exported_series(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_every_dashboard_query_names_only_exported_metrics(node: Node) -> None:
    port = free_port()
    node.start(cards(TESLA_P4, 1), metrics_port=port, metrics_address="127.0.0.1")
    node.kubelet.admit("a", "main", {node.memory: 4, node.core: 10})  # per-container series
    assert node.daemon is not None and node.daemon.core.refresher is not None
    assert node.daemon.core.refresher.refresh_once()
    exported = exported_series(scrape(port)[1])
    families = {name for name in exported if not name.endswith(SUFFIXES)}
    dashboard = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    for query in queries(dashboard):
        names = set(re.findall(r"\bgpushare_\w+", query))
        assert names, f"a query that names no gpushare metric: {query}"
        missing = names - exported
        assert not missing, f"{query} names metrics the daemon does not export: {missing}"
        used |= names
    # the dashboard shows the use figures the issue asks for
    for needed in (
        "gpushare_memory_bytes_allocated",
        "gpushare_container_memory_bytes",
        "gpushare_ready",
        "gpushare_registered",
        "gpushare_gpu_healthy",
        "gpushare_container_memory_used_bytes",  # actual use beside allocation
        "gpushare_container_core_utilization_percent",
        "gpushare_container_devices",  # whole cards and MIG devices held
    ):
        assert needed in used
    assert "gpushare_container_memory_bytes" in families  # a live per-container series


def test_the_dashboard_is_importable_json_with_unique_panel_ids() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "gpushare"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
