"""A rolling update with ``maxSurge: 1`` on one node (issue 39 item 5): two daemons of one
node at once, on one stand-in kubelet of 1.37 (endpoints keyed by socket path,
kubernetes#135437). Each instance names its sockets for itself, so the new daemon registers
beside the old one, the old one stops, and the kubelet's endpoint is a serving one
throughout: no "device plugin already connected" refusal, no moment without devices.

And what a daemon killed with ``kill -9`` leaves: its sockets, which the next daemon
removes at start, while it keeps every socket that answers (the other daemon of a
surge), and anything that is not a socket."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

from conftest import TESLA_P4, Node, cards
from kit.procs import daemon_command, poll
from structlog.testing import capture_logs

from gpushare.daemon import Daemon

HEALTHY = (29, 100)  # a Tesla P4's memory units and cores


class HealthyWatch:
    """The fewest healthy memory and core devices the kubelet held, at every change of
    its state (woken by each ListAndWatch message and stream end), until stopped."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.least = HEALTHY
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _note(self) -> bool:
        k, n = self.node.kubelet, self.node
        now = (k.healthy_count(n.memory), k.healthy_count(n.core))
        self.least = (min(self.least[0], now[0]), min(self.least[1], now[1]))
        return self.stopped.is_set()

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.node.kubelet.wait_for(lambda _k: self._note(), 0.05)

    def stop(self) -> tuple[int, int]:
        self.stopped.set()
        self.thread.join()
        self._note()
        return self.least


def our_sockets(node: Node) -> list[str]:
    return sorted(p.name for p in Path(node.settings.kubelet_dir).glob("gpushare-*.sock"))


def test_a_new_daemon_registers_beside_the_old_one_and_takes_over_on_1_37(node: Node) -> None:
    assert node.kubelet.version.startswith("v1.37")
    old = node.start(cards(TESLA_P4, 1))
    old_token = old.plugin.token
    old_names = {s.socket_path.name for s in old.plugin.servers}
    assert all(f".{old_token}." in n for n in old_names), old_names
    count = len(node.kubelet.registrations)
    watch = HealthyWatch(node)
    new = Daemon(node.settings, kubelet_version=lambda: node.kubelet.version)
    try:
        new.start()
        new_token = new.plugin.token
        assert new_token != old_token
        new_names = {s.socket_path.name for s in new.plugin.servers}
        # the new daemon registers beside the old one, on names of its own
        assert node.kubelet.wait_for(
            lambda k: {e for _r, e in k.registrations[count:]} >= new_names, 30.0
        ), node.kubelet.registrations[count:]
        assert node.kubelet.wait_for(
            lambda k: (
                {k.endpoint_socket(node.memory), k.endpoint_socket(node.core)}
                == {s.socket_path for s in new.plugin.servers}
            ),
            30.0,
        )
        # ... and left the old daemon's sockets alone: both sets are there, the old
        # daemon neither lost its sockets nor registered again
        assert set(our_sockets(node)) == old_names | new_names
        assert old.plugin.link is not None and old.plugin.link.registrations == 1
        assert all(s.socket_intact() for s in old.plugin.servers)
        # the old daemon stops (the DaemonSet deletes its pod once the new one is Ready)
        old.stop()
        node.daemon = new
        assert poll(lambda: set(our_sockets(node)) == new_names, 30.0), our_sockets(node)
        assert node.kubelet.wait_for(
            lambda k: (k.healthy_count(node.memory), k.healthy_count(node.core)) == HEALTHY, 30.0
        )
    finally:
        least = watch.stop()
    # never refused, never an endpoint that was not serving, never a device short
    assert node.kubelet.refused == []
    assert node.kubelet.unserved_at_registration == []
    assert least == HEALTHY, least
    assert new.plugin.link is not None and new.plugin.link.registrations == 1
    assert node.kubelet.admit("p", "main", {node.memory: 2, node.core: 10}).card()


def test_a_killed_daemons_sockets_are_removed_by_the_next_start(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    node.kubelet.start()
    proc = subprocess.Popen(daemon_command(node), stderr=subprocess.PIPE, text=True)
    try:
        assert node.wait_registered(30.0)
        killed = our_sockets(node)
        assert len(killed) == 2, killed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert our_sockets(node) == killed  # nobody removed them: the daemon had no chance
    plugin_dir = Path(node.settings.kubelet_dir)
    # what is not a socket, or not ours, stays: a file, a link, a dot file, another plugin's
    (plugin_dir / "gpushare-file.sock").write_text("not a socket")
    (plugin_dir / "gpushare-link.sock").symlink_to(plugin_dir / killed[0])
    others = [plugin_dir / ".gpushare-hidden.sock", plugin_dir / "vendor-gpu.sock"]
    for path in others:
        unserved_socket(path)
    # a socket of ours that answers: another live daemon's (the old one of a surge)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(plugin_dir / "gpushare-vcuda-memory.abcdef.sock"))
        live.listen(1)
        with capture_logs() as logs:
            daemon = node.start(cards(TESLA_P4, 1))
        names = {s.socket_path.name for s in daemon.plugin.servers}
        assert set(our_sockets(node)) == names | {
            "gpushare-vcuda-memory.abcdef.sock",
            "gpushare-file.sock",
            "gpushare-link.sock",
        }
    assert (plugin_dir / "gpushare-file.sock").read_text() == "not a socket"
    assert (plugin_dir / "gpushare-link.sock").is_symlink()
    assert all(path.exists() for path in others)
    assert not any((plugin_dir / name).exists() for name in killed)
    removed = [e["socket"] for e in logs if e["event"] == "stale_plugin_socket_removed"]
    assert sorted(removed) == [str(plugin_dir / name) for name in killed]  # one event each


def unserved_socket(path: Path) -> None:
    """A socket at ``path`` nobody listens on (what a killed process leaves)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:
        left.bind(str(path))
    assert path.exists() and not os.path.isdir(path)


def test_a_newer_endpoint_keeps_the_resources_devices_until_its_own_list_arrives(
    node: Node,
) -> None:
    """The kubelet keeps a resource's devices per resource: the new daemon's registration
    does not empty them while its ListAndWatch is yet to come (the stand-in once tied them
    to the endpoint, and the surge test above caught the count at 0 in that moment)."""
    old = node.start(cards(TESLA_P4, 1))
    count = len(node.kubelet.registrations)
    node.kubelet.watch_delay = 1.0  # a busy kubelet dials the new endpoint back late
    new = Daemon(node.settings, kubelet_version=lambda: node.kubelet.version)
    try:
        new.start()
        assert node.kubelet.wait_for(lambda k: len(k.registrations) >= count + 2, 30.0)
        # the last resource registered anew (the daemon waits for each stream before the
        # next registration: the core's is the one not opened yet): still every device
        fresh = node.kubelet.endpoints[node.core]
        assert fresh.socket in {s.socket_path for s in new.plugin.servers}
        assert fresh.updates == 0
        assert node.kubelet.healthy_count(node.core) == HEALTHY[1]
    finally:
        node.kubelet.watch_delay = 0.0
        new.stop()
        old.stop()
