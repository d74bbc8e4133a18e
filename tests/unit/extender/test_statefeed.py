"""gpushare.extender.statefeed: the extender's node cache follows the daemons' state
objects in their namespace (only those carrying the selector label), adopting the first
list whole and then each watched change; a deleted object leaves the node to its Node
annotation."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from kit.extender import PREFIX, card, event_loop_thread  # noqa: F401 - a fixture
from kit.procs import eventually

from gpushare.extender.nodecache import NodeCache
from gpushare.extender.statefeed import StateFeed
from gpushare.kube import nodestate, stateobject
from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint
from gpushare.sim.apidouble import KubeApiDouble

NAMESPACE = "kube-system"


def state_object(node: str, used: int, generation: int = 1) -> dict[str, Any]:
    text = nodestate.encode(nodestate.NodeGpuState(generation, "", 256, (card(0, used),)))
    return stateobject.state_object(PREFIX, NAMESPACE, node, f"uid-node-{node}", text)


def used(cache: NodeCache, node: str) -> int | None:
    held = cache.objects.get(node)
    state = held.record.state if held is not None else None
    return state.cards[0].memory_units_used if state is not None else None


def test_the_cache_follows_the_state_objects(
    api: KubeApiDouble,
    event_loop_thread: asyncio.AbstractEventLoop,  # noqa: F811
) -> None:
    api.add(state_object("gpu-a", 3))
    unlabelled = state_object("gpu-x", 1)
    del unlabelled["metadata"]["labels"][stateobject.selector_label(PREFIX)]
    api.add(unlabelled)  # not a daemon's: not read
    cache = NodeCache(expect_objects=True)
    endpoint = kubeconfig_endpoint(Path(os.environ["KUBECONFIG"]))
    feed = StateFeed(ApiClient(endpoint), PREFIX, NAMESPACE, cache, event_loop_thread)
    feed.start()
    try:
        eventually(lambda: cache.objects_listed)
        assert set(cache.objects) == {"gpu-a"} and used(cache, "gpu-a") == 3
        api.add(state_object("gpu-a", 5, generation=2))
        eventually(lambda: used(cache, "gpu-a") == 5)
        api.add(state_object("gpu-b", 1))
        eventually(lambda: used(cache, "gpu-b") == 1)
        api.delete("ConfigMap", stateobject.object_name("gpu-a"), NAMESPACE)
        eventually(lambda: "gpu-a" not in cache.objects)
        assert feed.lists == 1 and feed.events >= 3 and not feed.forbidden
    finally:
        feed.stop()
