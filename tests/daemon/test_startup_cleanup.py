"""A start-up that fails leaves nothing behind: no socket, no thread, no open file.

The composition root builds the device-plugin front door (its servers and the kubelet
link, whose directory watch holds an inotify descriptor and a pipe) before the node's
core parts start; a start that fails before the front door serves (a kubelet directory
that does not exist, a unit size refused under running containers) must not leave
those descriptors open, as the daemon before the composition root did not.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import CARD_4GIB, Node, cards
from kit.procs import poll

from gpushare.base.startup import BadKubeletDir, StartupError
from gpushare.daemon import Daemon


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fails_cleanly(node: Node, settings: object, error: type[StartupError]) -> None:
    """Start (and fail) twice: the first warms up what the process keeps once (gRPC's
    own machinery); the second must end with as many descriptors and threads as before."""
    with pytest.raises(error):
        Daemon(settings).start()  # type: ignore[arg-type]
    fds, threads = open_fds(), threading.active_count()
    with pytest.raises(error):
        Daemon(settings).start()  # type: ignore[arg-type]
    assert poll(lambda: open_fds() <= fds, 30.0), f"{open_fds() - fds} descriptors left open"
    assert poll(lambda: threading.active_count() <= threads, 30.0)
    sockets = [p.name for p in Path(node.settings.kubelet_dir).glob("*.sock")]
    assert sockets in ([], ["kubelet.sock"])


def test_a_missing_kubelet_dir_leaves_no_descriptor_open(node: Node) -> None:
    node.write_gpus(cards(CARD_4GIB, 1))
    missing = node.root / "no-such-kubelet" / "device-plugins"
    fails_cleanly(node, replace(node.settings, kubelet_dir=str(missing)), BadKubeletDir)


def test_a_refused_unit_size_leaves_no_descriptor_open(node: Node) -> None:
    node.start(cards(CARD_4GIB, 1), memory_unit_mib=1024)
    node.kubelet.admit("old", "main", {node.memory: 2})
    assert node.daemon is not None
    node.daemon.stop()
    node.daemon = None
    fails_cleanly(node, replace(node.settings, memory_unit_mib=256), StartupError)
