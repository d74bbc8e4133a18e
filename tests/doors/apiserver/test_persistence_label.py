"""The driver's persistence mode, checked at start, logged and put on the Node (issue 41
item 6): without it the driver is set up on the first open and torn down after the last
close, and a memory hook that opens NVML per container pays about 2 s each while no
process holds the driver open (the daemon's NVML handle does while it runs)."""

from __future__ import annotations

import structlog
from conftest import NODE, TESLA_P4, Node, cards
from kit.kube_double import KubeApiDouble
from kit.procs import poll

from gpushare.gpu.gpus import Gpu
from gpushare.kube import nodestate
from gpushare.kube.labels import persistence_labels

KEY = "gpushare.io/persistence-mode"


def card(index: int, mode: bool | None) -> Gpu:
    return Gpu(f"GPU-{index}", "Tesla T4", 15360, index, index, persistence_mode=mode)


def test_the_label_says_on_off_or_mixed_and_is_absent_where_unknown() -> None:
    assert persistence_labels("gpushare.io", [card(0, True), card(1, True)]) == {KEY: "on"}
    assert persistence_labels("gpushare.io", [card(0, False), card(1, None)]) == {KEY: "off"}
    assert persistence_labels("gpushare.io", [card(0, False), card(1, True)]) == {KEY: "mixed"}
    assert persistence_labels("gpushare.io", [card(0, None)]) == {}
    assert KEY in nodestate.label_keys("gpushare.io")  # removed with the daemon's others


def test_the_daemon_logs_and_labels_a_node_without_persistence_mode(
    node: Node, api: KubeApiDouble
) -> None:
    node.write_gpus(cards(TESLA_P4, 2, persistence_mode=False))
    node.kubelet.start()
    node.settings = node.settings.__class__(**{**node.settings.__dict__, "node_name": NODE})
    from gpushare.daemon import Daemon

    with structlog.testing.capture_logs() as logs:
        node.daemon = Daemon(node.settings)
        node.daemon.start()

        def labels() -> dict[str, str]:
            return dict(api.get("Node", NODE)["metadata"].get("labels") or {})

        assert poll(lambda: KEY in labels(), 30.0)
    assert labels()[KEY] == "off"
    events = [e for e in logs if e["event"] == "persistence_mode"]
    assert sorted(e["index"] for e in events) == [0, 1]
    assert {e["mode"] for e in events} == {"off"} and all("2 s" in e["detail"] for e in events)
