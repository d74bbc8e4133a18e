"""Freed room to binding: the churn scenario of issue 26, against the stand-ins.

``python -m gpushare.sim.churn`` (``make churn``) runs one GPU node (the real daemon on
simulated Tesla P4 cards, the kubelet stand-in over gRPC), the API-server double over
HTTP, the real extender over HTTP (binding through the double, watching its pods), and
a scheduler stand-in that behaves as kube-scheduler does towards a pod the extender
refused: the pod waits until a cluster event (a pod deleted, its Node updated) moves
it back to the queue, and not before its back-off (1 s, doubling per attempt, at most
10 s: kube-scheduler's defaults) has run out.

Each round: the node's cards are full; pods that fit only in room about to be freed
are created and refused; then running pods are deleted (the kubelet frees their units
and the API server tells), and the time from the deletion to each waiting pod's
binding, and to its admission by the kubelet, is recorded. With the extender's pod
watch the room is seen at the deletion event; without it (``--no-watch-pods``), at
the daemon's next Node update. During the churn every card's use is checked against
its capacity and every admission must succeed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.extender.httpserver import ExtenderSettings, build_app, start
from gpushare.sim.apidouble import KubeApiDouble
from gpushare.sim.daemonnode import DaemonNode
from gpushare.sim.kubeletdouble import AdmissionError

NODE = "churn-node"
P4_MIB = 7611  # 29 units
UNITS = 9  # three pods of 9 units fill a card (27 of 29)
INITIAL_BACKOFF, MAX_BACKOFF = 1.0, 10.0


@dataclass
class Waiting:
    name: str
    attempts: int = 0
    next_try: float = 0.0  # its back-off runs out
    woken: bool = False  # a cluster event came since its last attempt


@dataclass
class Results:
    bind: list[float] = field(default_factory=list)
    admit: list[float] = field(default_factory=list)
    publish: list[float] = field(default_factory=list)
    refused_admissions: int = 0
    overcommitted: int = 0


class Extender:
    def __init__(self, settings: ExtenderSettings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        runner, self.port = await start(build_app(self.settings), "127.0.0.1", 0)
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def __enter__(self) -> Extender:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the extender did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def post(self, verb: str, body: Any) -> Any:
        import json
        import urllib.request

        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/gpushare/{verb}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read())


class Informer:
    """kube-scheduler's view of cluster events: its own watches of pods and Nodes over
    HTTP, as late as the extender's (an event counts when the watch delivers it)."""

    def __init__(self, url: str) -> None:
        from gpushare.extender.podfeed import endpoint_of
        from gpushare.kube.stdlibclient import ApiClient

        self.client = ApiClient(endpoint_of(url, "", ""))
        self.events = 0
        self.node_events = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch, args=(path,), daemon=True)
            for path in ("/api/v1/pods", "/api/v1/nodes")
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, path: str) -> None:
        version = str(self.client.get(path).get("metadata", {}).get("resourceVersion", ""))
        while not self._stop.is_set():
            query = {"resourceVersion": version, "timeoutSeconds": "5"}
            for kind, obj in self.client.watch(path, query, read_timeout=10):
                version = str(obj.get("metadata", {}).get("resourceVersion", version))
                if kind == "DELETED" or path.endswith("nodes"):
                    with self._lock:
                        self.events += 1
                        self.node_events += path.endswith("nodes")


class Churn:
    def __init__(
        self, api: KubeApiDouble, node: DaemonNode, extender: Extender, informer: Informer
    ) -> None:
        self.api, self.node, self.extender, self.informer = api, node, extender, informer
        self.count = 0
        self.results = Results()

    def pod(self, memory: int) -> str:
        self.count += 1
        name = f"pod-{self.count}"
        limits = {"gpushare.io/vcuda-memory": str(memory), "gpushare.io/vcuda-core": "10"}
        self.api.add(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
                "status": {"phase": "Pending"},
            }
        )
        return name

    def try_schedule(self, name: str) -> bool:
        the_pod = self.api.get("Pod", name, "default")
        the_node = self.api.get("Node", NODE)
        assert the_pod is not None and the_node is not None
        answer = self.extender.post("filter", {"Pod": the_pod, "Nodes": {"items": [the_node]}})
        if not answer["Nodes"]["items"]:
            return False
        meta = the_pod["metadata"]
        body = {"PodName": name, "PodNamespace": "default", "PodUID": meta["uid"], "Node": NODE}
        return not self.extender.post("bind", body)["Error"]

    def admit(self, name: str) -> None:
        memory, core = self.node.settings.memory_resource, self.node.settings.core_resource
        try:
            self.node.kubelet.admit(name, "main", {memory: UNITS, core: 10})
        except AdmissionError:
            self.results.refused_admissions += 1
            raise
        the_pod = self.api.get("Pod", name, "default")
        assert the_pod is not None
        the_pod["status"] = {"phase": "Running"}
        self.api.add(the_pod)
        self.check_cards()

    def check_cards(self) -> None:
        used: dict[str, int] = {}
        for admitted in self.node.kubelet.admitted.values():
            for device in admitted.devices.get(self.node.settings.memory_resource, []):
                card = device.rsplit("::", 1)[0]
                used[card] = used.get(card, 0) + 1
        self.results.overcommitted += sum(1 for n in used.values() if n > P4_MIB // 256)

    def fill(self) -> list[str]:
        running = []
        for _ in range(3 * len(self.node.cards)):
            name = self.pod(UNITS)
            # A refusal may be the extender counting a pod bound a moment ago twice, by its
            # hold and by the daemon's state that shows the pod's units before it lists the
            # pod (a loaded machine stretches that moment): the safe side, and a scheduler
            # tries the pod again as the Node's state moves on. Filling an empty node must
            # succeed once the state has caught up, not at the first try.
            deadline = time.monotonic() + 60
            while not self.try_schedule(name):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} does not fit an empty node")
                time.sleep(0.05)
            self.admit(name)
            running.append(name)
        return running

    def published_free(self) -> int:
        from gpushare.kube import nodestate

        the_node = self.api.get("Node", NODE) or {}
        text = (the_node.get("metadata", {}).get("annotations") or {}).get("gpushare.io/gpus")
        if not text:
            return 0
        return sum(c.memory_units_free for c in nodestate.decode(text).cards)

    def round(self, running: list[str], delete: int) -> list[str]:
        """Pods wait, ``delete`` running pods go; returns the node's running pods after."""
        waiting = [Waiting(self.pod(UNITS)) for _ in range(delete)]
        now = time.monotonic()
        for pod in waiting:  # refused once: they wait in back-off for an event
            if self.try_schedule(pod.name):
                raise RuntimeError("a waiting pod found room before any deletion")
            pod.attempts, pod.next_try = 1, now + INITIAL_BACKOFF
        # They have waited a while (their first back-off has run out) when pods end.
        time.sleep(INITIAL_BACKOFF * 1.2)
        gone, running = running[:delete], running[delete:]
        node_events = self.informer.node_events
        deleted_at = time.monotonic()
        for name in gone:
            self.node.kubelet.release(name)
            self.api.delete("Pod", name, "default")
        published = False
        seen = self.informer.events
        deadline = deleted_at + 120
        while waiting and time.monotonic() < deadline:
            events = self.informer.events
            if events != seen:  # a pod deleted, a Node updated: pods are retried
                seen = events
                for pod in waiting:
                    pod.woken = True
            if not published and self.informer.node_events != node_events:
                published = True
                self.results.publish.append(time.monotonic() - deleted_at)
            for pod in list(waiting):
                if not pod.woken or time.monotonic() < pod.next_try:
                    continue
                if self.try_schedule(pod.name):
                    self.results.bind.append(time.monotonic() - deleted_at)
                    self.admit(pod.name)
                    self.results.admit.append(time.monotonic() - deleted_at)
                    waiting.remove(pod)
                    running.append(pod.name)
                else:
                    pod.attempts += 1
                    backoff = min(MAX_BACKOFF, INITIAL_BACKOFF * 2 ** (pod.attempts - 1))
                    pod.next_try = time.monotonic() + backoff
                    pod.woken = False
            time.sleep(0.002)
        if waiting:
            raise RuntimeError(f"{len(waiting)} pods never bound")
        return running


def run(rounds: int, watch_pods: bool, delete: int = 3, legacy: bool = False) -> Results:
    """``legacy``: the daemon does not publish on release (as before issue 26): its state
    is published at admissions only (before the state object, also every 30 s)."""
    if legacy:
        import gpushare.daemon

        names = vars(gpushare.daemon)
        saved = names["watch_releases"]
        names["watch_releases"] = lambda *_args: None
        try:
            return run(rounds, watch_pods, delete)
        finally:
            names["watch_releases"] = saved
    api = KubeApiDouble()
    api.start()
    work = Path(tempfile.mkdtemp(prefix="gs-churn-", dir="/tmp"))
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(api.kubeconfig(work / "kubeconfig"))
    api.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {}}})
    cards = [(f"GPU-churn-{i:04d}", "Tesla P4", P4_MIB) for i in range(3)]
    node = DaemonNode(NODE, cards, "binpack", seed=1)
    node.settings = _with_node(node.settings)
    settings = ExtenderSettings(
        port=0, api_server=api.url, token_file="", ca_file="", watch_pods=watch_pods
    )
    try:
        node.start()
        deadline = time.monotonic() + 30
        while not churn_published(api):
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not publish")
            time.sleep(0.05)
        informer = Informer(api.url)
        informer.start()
        with Extender(settings) as extender:
            churn = Churn(api, node, extender, informer)
            running = churn.fill()
            for _ in range(rounds):
                running = churn.round(running, delete)
            informer.stop()
            return churn.results
    finally:
        node.stop()
        api.stop()
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous


def churn_published(api: KubeApiDouble) -> bool:
    the_node = api.get("Node", NODE) or {}
    return "gpushare.io/gpus" in ((the_node.get("metadata") or {}).get("annotations") or {})


def _with_node(settings: Any) -> Any:
    from dataclasses import replace

    return replace(settings, node_name=NODE)


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))
    return ordered[position]


def table(rows: list[tuple[str, Results]]) -> str:
    lines = [
        "| extender | pods | deletion to binding p50 / p95 / max | deletion to admission "
        "p50 / p95 | deletion to the next Node update p50 | refused admissions | "
        "overcommitted cards |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows:

        def fmt(values: list[float]) -> str:
            return f"{percentile(values, 0.5):.2f} / {percentile(values, 0.95):.2f}"

        publish = statistics.median(r.publish) if r.publish else float("nan")
        lines.append(
            f"| {label} | {len(r.bind)} | {fmt(r.bind)} / {max(r.bind):.2f} s | "
            f"{fmt(r.admit)} s | {publish:.2f} s | {r.refused_admissions} | {r.overcommitted} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpushare-churn", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--delete", type=int, default=3, help="pods deleted per round")
    parser.add_argument(
        "--legacy", action="store_true", help="also measure the daemon without publish-on-release"
    )
    args = parser.parse_args(argv)
    from gpushare.base.logs import configure_logging

    configure_logging("console", "error")
    rows = [
        ("with its pod watch", run(args.rounds, True, args.delete)),
        ("without (--no-watch-pods)", run(args.rounds, False, args.delete)),
    ]
    if args.legacy:
        rows.append(
            (
                "without, daemon publishing only on admission (before)",
                run(args.rounds, False, args.delete, legacy=True),
            )
        )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
