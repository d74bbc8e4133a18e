"""gpushare.node.releases: a pod of the node that ends makes the records be read again
at once, and again while the ended pod still shows in them (up to a wait), and a read
whose counts changed publishes the node's state; unchanged reads publish nothing."""

from __future__ import annotations

from typing import Any

from gpushare.node.releases import RELEASE_WAIT_SECONDS, ReleaseWatch, watch_releases
from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder


def pod(name: str, phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": name}, "status": {"phase": phase}}


def holding(*pods: str) -> Snapshot:
    snapshot = Snapshot(taken_at=0.0)
    for i, name in enumerate(pods):
        holder = Holder("ns", name, "main")
        snapshot.holders[(Resource.MEMORY, f"GPU-0::{i}")] = holder
        snapshot.devices[holder] = {Resource.MEMORY: [f"GPU-0::{i}"]}
    return snapshot


class Journal:
    def __init__(self) -> None:
        self.now = 100.0
        self.calls: list[str] = []
        self.watch = ReleaseWatch(
            lambda: self.calls.append("poke"),
            lambda: self.calls.append("publish"),
            lambda: self.now,
        )

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def test_an_ended_pod_is_read_again_until_the_records_drop_it() -> None:
    j = Journal()
    j.watch.pods_changed([pod("a"), pod("b")])
    assert j.take() == []  # nothing ended
    j.watch.records_read(holding("a", "b"))
    assert j.take() == ["publish"]  # the first view is new
    j.watch.pods_changed([pod("a"), pod("b", "Succeeded")])
    assert j.take() == ["poke"] and j.watch.released_seen == 1
    j.watch.records_read(holding("a", "b"))  # still listed: look again soon
    assert j.take() == ["poke"]
    j.watch.records_read(holding("a"))  # gone: publish, and stop looking
    assert j.take() == ["publish"]
    j.watch.records_read(holding("a"))
    assert j.take() == []


def test_the_wait_for_an_ended_pod_is_bounded() -> None:
    j = Journal()
    j.watch.pods_changed([pod("a")])
    j.watch.pods_changed([])  # deleted
    assert j.take() == ["poke"]
    j.watch.records_read(holding("a"))
    assert j.take() == ["publish", "poke"]
    j.now += RELEASE_WAIT_SECONDS
    j.watch.records_read(holding("a"))  # a kubelet that never drops it: given up
    assert j.take() == []


def test_watch_releases_wires_the_pod_watch_and_the_records() -> None:
    class Refresher:
        def __init__(self) -> None:
            self.read_listeners: list[Any] = []
            self.pokes = 0

        def poke(self) -> None:
            self.pokes += 1

    class Link:
        def __init__(self) -> None:
            self.pod_listeners: list[Any] = []
            self.changes = 0

        def notify_changed(self) -> None:
            self.changes += 1

    refresher, link = Refresher(), Link()
    watch = watch_releases(refresher, link)
    assert link.pod_listeners == [watch.pods_changed]
    assert refresher.read_listeners == [watch.records_read]
    link.pod_listeners[0]([pod("a")])
    link.pod_listeners[0]([])
    refresher.read_listeners[0](holding())
    assert (refresher.pokes, link.changes) == (1, 1)
