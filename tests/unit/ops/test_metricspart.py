"""gpushare.ops.metricspart: the metrics part answers the probes before the node's core
exists (``gpushare_ready 0``), exports the core once it is read, and a port already taken
is a start-up error that names the flag."""

from __future__ import annotations

import json
import socket
from dataclasses import replace

import pytest
from conftest import TESLA_P4, Node, cards
from kit.procs import free_port, scrape

from gpushare.base.startup import StartupError
from gpushare.ops.metricspart import MetricsPart


def test_probes_first_then_the_cores_figures(node: Node) -> None:
    daemon = node.start(cards(TESLA_P4, 2))  # no metrics port: the part is made here
    port = free_port()
    settings = replace(node.settings, metrics_port=port, metrics_address="127.0.0.1")
    part = MetricsPart(settings, lambda: (True, "alive"), lambda: (False, "starting"))
    part.start()
    try:
        assert part.ready() == (True, "")
        status, text = scrape(port)
        assert status == 200 and "gpushare_ready 0" in text
        assert "gpushare_units" not in text.replace("gpushare_ready", "")
        assert scrape(port, "/healthz")[0] == 200
        status, text = scrape(port, "/readyz")
        assert status == 503 and json.loads(text) == {"ready": False, "reason": "starting"}
        assert daemon.core is not None
        metrics = part.read(daemon.core, lambda: {node.memory: True, node.core: True})
        assert part.metrics is metrics
        status, text = scrape(port)
        assert status == 200
        memory_lines = [
            line
            for line in text.splitlines()
            if line.startswith("gpushare_") and node.memory in line
        ]
        assert memory_lines, text[:2000]
    finally:
        part.stop()


def test_a_port_in_use_is_a_startup_error_naming_the_flag(node: Node) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = replace(node.settings, metrics_port=port, metrics_address="127.0.0.1")
        part = MetricsPart(settings, lambda: (True, ""), lambda: (True, ""))
        with pytest.raises(StartupError, match="--metrics-port"):
            part.start()
