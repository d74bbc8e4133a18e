"""gpushare.extender.feedthread: the list-then-watch thread both extender feeds run:
a cycle lists, watches from the list's version, hands every watched object over on the
event loop, and stop() ends the thread even while a watch is open."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from kit.extender import event_loop_thread, node  # noqa: F401 - a fixture
from kit.procs import eventually

from gpushare.extender.feedthread import ListWatchFeed
from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint
from gpushare.sim.apidouble import KubeApiDouble


class Names(ListWatchFeed):
    """The smallest feed: Node names, listed then watched."""

    path = "/api/v1/nodes"
    thread_name = "names-feed"

    def __init__(self, client: ApiClient, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(client, loop)
        self.seen: list[tuple[str, str]] = []
        self.threads: set[str] = set()

    def _record(self, kind: str, name: str) -> None:
        self.seen.append((kind, name))
        self.threads.add("loop" if asyncio.get_running_loop() is self.loop else "other")

    def _cycle(self) -> None:
        if not self._resume:
            answer = self.client.get(self.path, timeout=5)
            for item in answer["items"]:
                self._call(self._record, "LISTED", item["metadata"]["name"])
            self._resume = str(answer["metadata"]["resourceVersion"])
            self.lists += 1
        self._watch_once()

    def _watched(self, kind: str, obj: dict[str, Any]) -> None:
        self._call(self._record, kind, obj["metadata"]["name"])


def test_list_then_watch_on_the_loop_and_stop_ends_an_open_watch(
    api: KubeApiDouble,
    event_loop_thread: asyncio.AbstractEventLoop,  # noqa: F811
) -> None:
    feed = Names(ApiClient(kubeconfig_endpoint(Path(os.environ["KUBECONFIG"]))), event_loop_thread)
    feed.start()
    try:
        eventually(lambda: feed.seen)
        assert feed.seen == [("LISTED", "gpu-node-1")]
        eventually(lambda: feed._current is not None)  # watching from the list's version
        api.add(node("gpu-a"))
        eventually(lambda: ("ADDED", "gpu-a") in feed.seen)
        assert ("LISTED", "gpu-a") not in feed.seen and feed.lists == 1
        assert feed.threads == {"loop"}
    finally:
        feed.stop()
    assert feed._thread is not None and not feed._thread.is_alive()
