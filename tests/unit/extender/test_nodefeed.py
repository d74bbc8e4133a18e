"""gpushare.extender.nodefeed: the extender's node cache follows the API server's Nodes:
the first list is adopted whole (each node's published cards decoded once), then each
watched change and deletion, written on the extender's event loop."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from conftest import NODE
from kit.extender import PREFIX, card, event_loop_thread, node  # noqa: F401 - a fixture
from kit.procs import eventually

from gpushare.extender.nodecache import NodeCache
from gpushare.extender.nodefeed import NodeFeed
from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint
from gpushare.sim.apidouble import KubeApiDouble


def client() -> ApiClient:
    return ApiClient(kubeconfig_endpoint(Path(os.environ["KUBECONFIG"])), metadata_only=True)


def test_the_cache_follows_the_nodes(
    api: KubeApiDouble,
    event_loop_thread: asyncio.AbstractEventLoop,  # noqa: F811
) -> None:
    api.add(node("gpu-a", [card(0, used=2)]))
    cache = NodeCache()
    feed = NodeFeed(client(), PREFIX, cache, event_loop_thread)
    feed.start()
    try:
        eventually(lambda: cache.listed)
        assert set(cache.records) == {NODE, "gpu-a"} and feed.lists == 1
        assert cache.records[NODE].code == "no_gpus"
        listed = cache.records["gpu-a"]
        assert listed.state is not None and listed.state.cards[0].memory_units_used == 2
        api.add(node("gpu-a", [card(0, used=7)], generation=2))
        eventually(lambda: (r := cache.get("gpu-a")) and r.state and r.state.generation == 2)
        api.add(node("gpu-b", [card(0)]))
        eventually(lambda: "gpu-b" in cache.records)
        api.delete("Node", "gpu-a")
        eventually(lambda: "gpu-a" not in cache.records)
        assert feed.events >= 3 and feed.lists == 1  # watched, not listed again
    finally:
        feed.stop()
