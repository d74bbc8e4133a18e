"""Building kube-scheduler's requests for the extender, and the real extender app served
from a thread on 127.0.0.1 (shared by the extender's tests).

kube-scheduler (nodeCacheCapable: false) POSTs ExtenderArgs with capitalised keys:
``{"Pod": <Pod>, "Nodes": {"items": [<Node>...]}, "NodeNames": null}``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpushare.extender.bindingclient import BindingClient
from gpushare.extender.httpserver import ExtenderSettings, build_app, start
from gpushare.extender.ledger import AdmissionLedger
from gpushare.kube import nodestate
from gpushare.sim.apidouble import KubeApiDouble

PREFIX = "gpushare.io"
MEMORY = f"{PREFIX}/vcuda-memory"
CORE = f"{PREFIX}/vcuda-core"
P4_MIB = 7611  # 29 units of 256 MiB


# -- building the scheduler's objects ------------------------------------------------


def card(
    index: int,
    used: int = 0,
    *,
    memory_mib: int = 4096,
    cores_used: int = 0,
    healthy: bool = True,
    name: str = "Test",
) -> nodestate.CardState:
    return nodestate.CardState(
        uuid=f"GPU-{index:04d}-{memory_mib}",
        index=index,
        name=name,
        memory_mib=memory_mib,
        memory_units=memory_mib // 256,
        memory_units_used=used,
        core_units=100,
        core_units_used=cores_used,
        healthy=healthy,
    )


def node(
    name: str, cards: list[nodestate.CardState] | None = None, generation: int = 1
) -> dict[str, Any]:
    """A Node object as the API server serialises it (trimmed to what matters)."""
    annotations = {"node.alpha.kubernetes.io/ttl": "0"}
    cards = cards or []
    if cards:
        state = nodestate.NodeGpuState(generation, "2026-11-22T13:00:00Z", 256, tuple(cards))
        annotations[nodestate.annotation_key(PREFIX)] = nodestate.encode(state)
    units = sum(c.memory_units for c in cards) or 32
    labels = {
        "kubernetes.io/hostname": name,
        # one of the labels the daemon writes on its node (nodestate.label_keys)
        nodestate.label_key(PREFIX, "count"): str(max(len(cards), 1)),
    }
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": f"uid-node-{name}",
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {},
        "status": {
            "capacity": {"cpu": "8", MEMORY: str(units), CORE: str(100 * max(len(cards), 1))},
            "allocatable": {"cpu": "8", MEMORY: str(units), CORE: str(100 * max(len(cards), 1))},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def container(name: str, memory: int = 0, core: int = 0) -> dict[str, Any]:
    limits = {"cpu": "1"}
    if memory:
        limits[MEMORY] = str(memory)
    if core:
        limits[CORE] = str(core)
    return {"name": name, "image": "cuda:12", "resources": {"limits": limits, "requests": limits}}


def pod(name: str, *containers: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {"containers": list(containers), "schedulerName": "default-scheduler"},
        "status": {"phase": "Pending"},
    }


def args(the_pod: dict[str, Any], *nodes: dict[str, Any]) -> dict[str, Any]:
    return {"Pod": the_pod, "Nodes": {"items": list(nodes)}, "NodeNames": None}


# -- a running extender --------------------------------------------------------------


class RunningExtender:
    """The real aiohttp app on 127.0.0.1 and a free port, served from a thread."""

    def __init__(self, settings: ExtenderSettings, binder: BindingClient | None = None) -> None:
        self.ledger = AdmissionLedger(settings.ledger_timeout_seconds)
        self.binder = binder
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stopped = asyncio.Event()
        app = build_app(self.settings, self.ledger, self.binder)
        runner, self.port = await start(app, "127.0.0.1", 0)
        self._ready.set()
        await self._stopped.wait()
        await runner.cleanup()

    def __enter__(self) -> RunningExtender:
        self._thread.start()
        assert self._ready.wait(60), "the extender did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stopped is not None
        self.loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)

    def post(self, verb: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        url = f"http://127.0.0.1:{self.port}{self.settings.url_prefix}/{verb}"
        request = urllib.request.Request(
            url, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def filter(self, body: Any) -> dict[str, Any]:
        status, answer = self.post("filter", body)
        assert status == 200, answer
        assert isinstance(answer, dict)
        return answer


@pytest.fixture
def extender_factory() -> Iterator[Callable[..., RunningExtender]]:
    running: list[RunningExtender] = []

    def make(binder: BindingClient | None = None, **overrides: Any) -> RunningExtender:
        settings = ExtenderSettings(url_prefix="/gpushare", **overrides)
        server = RunningExtender(settings, binder).__enter__()
        running.append(server)
        return server

    yield make
    for server in running:
        server.__exit__()


@pytest.fixture
def api() -> Iterator[KubeApiDouble]:
    """A bare API-server double for the extender's watches and binds (no Node in it,
    unlike the suite's ``api``: each test adds the nodes it needs)."""
    double = KubeApiDouble()
    double.start()
    yield double
    double.stop()


@pytest.fixture
def extender(extender_factory: Callable[..., RunningExtender]) -> RunningExtender:
    return extender_factory()


def kept(answer: dict[str, Any]) -> list[str]:
    return [n["metadata"]["name"] for n in answer["Nodes"]["items"]]


def get(server: RunningExtender, path: str) -> tuple[int, str]:
    url = f"http://127.0.0.1:{server.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture
def event_loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread, as the extender's: what its feeds write to."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
