"""The daemon's parts: optional ones absent (not even imported) when off, all stopped."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import TESLA_P4, Node, cards
from kit.kube_double import KubeApiDouble
from kit.procs import daemon_command, free_port

START_AND_LIST_MODULES = textwrap.dedent(
    """
    import sys
    from gpushare.config import load_settings
    from gpushare.daemon import Daemon
    daemon = Daemon(load_settings(sys.argv[1:]))
    daemon.start()
    registered = daemon.plugin.link.registered.wait(20)
    optional = ("prometheus_client", "http.server", "http.client", "gpushare.ops.daemonmetrics",
                "gpushare.kube.apilink", "gpushare.kube.stdlibclient", "kubernetes")
    loaded = sorted(m for m in optional if m in sys.modules)
    daemon.stop()
    print(registered, loaded, flush=True)
    """
)


def test_without_metrics_and_node_name_their_modules_stay_unloaded(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    node.kubelet.start()
    command = daemon_command(node, "--log-level", "error", port=0)
    command[1:3] = ["-c", START_AND_LIST_MODULES]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "True []"


def test_optional_parts_are_absent_when_off_and_everything_stops(node: Node) -> None:
    daemon = node.start(cards(TESLA_P4, 1))
    assert daemon.plugin is not None and daemon.core is not None
    sockets = [server.socket_path.name for server in daemon.plugin.servers]
    assert daemon.parts == (
        "pod-resources",
        "reaper",  # the interposer is installed: buried cache directories are deleted
        "health-monitor",
        "device-plugin",  # its servers and their registration with the kubelet
        "usage-refresher",
    )
    assert daemon.metrics_part is None and daemon.core.api_link is None
    daemon.stop()
    assert daemon.parts == ()
    assert sockets and not any(Path(node.settings.kubelet_dir, s).exists() for s in sockets)


def test_metrics_come_first_and_the_api_link_after_the_device_plugin(
    node: Node, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    double = KubeApiDouble()
    double.start()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(double.kubeconfig(short_tmp / "kubeconfig")))
    try:
        daemon = node.start(cards(TESLA_P4, 1), metrics_port=free_port(), node_name="n")
        parts = daemon.parts
        assert parts[0] == "metrics-server"
        assert parts.index("api-link") == parts.index("device-plugin") + 1
        node.stop()
        assert daemon.parts == ()
    finally:
        double.stop()
