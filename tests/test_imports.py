"""Optional features cost nothing when off: their modules are never imported."""

from __future__ import annotations

import subprocess
import textwrap

from conftest import TESLA_P4, Node, cards
from procs import daemon_command

START_AND_LIST_MODULES = textwrap.dedent(
    """
    import sys
    from gpushare.config import load_settings
    from gpushare.daemon import Daemon
    daemon = Daemon(load_settings(sys.argv[1:]))
    daemon.start()
    registered = daemon.link.registered.wait(20)
    optional = ("prometheus_client", "http.server", "http.client", "gpushare.metrics",
                "gpushare.node", "gpushare.kubeclient", "kubernetes")
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
