"""The socket renewal's transient (issue 41.8): a second offer to the same kubelet comes
on a fresh socket path, and how the old server gives way follows the kubelet's version.

On 1.37 (endpoints keyed by socket path, kubernetes#135437) the new server is started and
registered before the old one stops: the kubelet's endpoint is never a stopped server.
On 1.36 (one client per resource, kubernetes#121994) the old stream's end disconnects
whichever client is current, so overlapping would kill the new endpoint: the old server
stops first, as before. The stand-in kubelet models both (``version``) and notes each
registration that found the resource's current endpoint not serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TESLA_P4, Node, cards
from kit.procs import poll

from gpushare.deviceplugin.registration import UNWATCHED_GRACE, make_before_break
from gpushare.sim.kubeletdouble import SimulatedKubelet

HEALTHY = (29, 100)  # a Tesla P4's memory units and cores


def use_kubelet(node: Node, version: str) -> None:
    node.kubelet = SimulatedKubelet(
        Path(node.settings.kubelet_dir), Path(node.settings.pod_resources_socket), version=version
    )


def renew_once(node: Node) -> list[tuple[str, str]]:
    """A kubelet (restarted) that dials back after the grace: the daemon registers each
    resource again, on a fresh path, while the kubelet still holds the first endpoint.
    The registrations since the restart."""
    node.kubelet.watch_delay = UNWATCHED_GRACE + 1.0
    count = len(node.kubelet.registrations)
    node.kubelet.restart()
    assert node.daemon is not None and node.daemon.plugin.link is not None
    link = node.daemon.plugin.link
    assert poll(lambda: link.unwatched_retries >= 1, 60.0)
    assert node.kubelet.wait_for(
        lambda k: (k.healthy_count(node.memory), k.healthy_count(node.core)) == HEALTHY, 60.0
    )
    assert poll(lambda: link.registered.is_set(), 30.0)
    return node.kubelet.registrations[count:]


def test_on_1_37_the_kubelets_endpoint_is_never_a_stopped_server(node: Node) -> None:
    use_kubelet(node, "v1.37.2")
    node.start(cards(TESLA_P4, 1))
    later = renew_once(node)
    assert len(later) >= 4, later  # the first paths, then the fresh ones
    assert len(later) == len(set(later)), later
    assert node.kubelet.refused == []
    # every renewal found the endpoint it replaced still answering
    assert node.kubelet.unserved_at_registration == []
    # and the old servers are gone once they made way: one socket of ours per resource
    plugin_dir = Path(node.settings.kubelet_dir)
    assert poll(lambda: len(list(plugin_dir.glob("gpushare-*.sock"))) == 2, 30.0)
    assert node.kubelet.admit("p", "main", {node.memory: 2, node.core: 10}).card()


def test_on_1_36_the_old_server_stops_first_and_the_new_endpoint_lives(node: Node) -> None:
    """Overlapping would be worse on 1.36: the old stream's end disconnects the new
    client. The daemon breaks before it makes there, and the node ends healthy."""
    use_kubelet(node, "v1.36.3")
    node.start(cards(TESLA_P4, 1))
    renew_once(node)
    assert node.kubelet.unserved_at_registration  # the moment 1.36 cannot avoid
    # the new endpoints stay: no late stream end disconnects them
    assert node.kubelet.wait_for(lambda k: k.healthy_count(node.memory) == HEALTHY[0], 10.0)
    assert node.kubelet.admit("p", "main", {node.memory: 2, node.core: 10}).card()


def test_the_stand_in_1_36_kubelet_kills_an_endpoint_that_overlapped(node: Node) -> None:
    """What the daemon avoids on 1.36, shown on the stand-in: told 1.37 (make-before-break)
    while the kubelet is 1.36, the old stream's end takes the new endpoint down with it."""
    use_kubelet(node, "v1.36.3")
    node.start(cards(TESLA_P4, 1))
    assert node.daemon is not None
    node.daemon.plugin.kubelet_version = lambda: "v1.37.2"
    node.kubelet.watch_delay = UNWATCHED_GRACE + 1.0
    node.kubelet.restart()
    assert node.daemon.plugin.link is not None
    link = node.daemon.plugin.link
    assert poll(lambda: link.unwatched_retries >= 1, 60.0)
    # a renewed endpoint was disconnected by the old stream's end
    assert node.kubelet.wait_for(lambda k: k.newer_disconnected >= 1, 60.0)


@pytest.mark.parametrize(
    ("version", "overlap"),
    [
        ("v1.37.2", True),
        ("v1.37.0-alpha.1", True),
        ("1.38.1", True),
        ("v2.0.0", True),
        ("v1.36.3", False),
        ("v1.36.3-eks-1234", False),
        ("v1.9.0", False),
        ("", False),
        ("v1", False),
        ("vX.37", False),
        ("v1.٣٧.0", False),
    ],
)
def test_make_before_break_is_chosen_from_the_kubelets_version(version: str, overlap: bool) -> None:
    assert make_before_break(version) is overlap
