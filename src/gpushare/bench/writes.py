"""``python -m gpushare.bench.writes``: the daemons' writes to the API server, per node.

Runs the daemon's real :class:`~gpushare.kube.apilink.ApiLink` for N nodes (8 A100s
each) in one process against the API-server double (:mod:`gpushare.sim.apidouble`),
drives pods onto and off their cards at a given rate (each pod holds units on one card
for :data:`POD_MINUTES` minutes), and counts the writes the double receives (PATCH, PUT,
POST) by object: the Node, the node's state object, anything else. Time is compressed:
every interval of the link (settle, spacing, the read-back or the forced rewrite) and of
the pods is divided by ``--speed``, so a simulated minute takes 60/speed seconds; the
rows are per simulated minute. Each mode runs in a process of its own.

``--baseline-src DIR`` adds a "before" row: the same driver run against the
``src/`` of another checkout (e.g. ``git worktree add /tmp/before <commit>``), whose
link knows no ``--node-state`` (the card state as a Node annotation, rewritten every
30 s). The table goes to ``--out`` and, with ``--write FILE``, replaces the
``<!-- writes table -->`` block of FILE.

The pods' own annotation (one PATCH per admitted pod, ``<prefix>/gpu.<container>``) is
not driven here: it is the same in every mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported in the child process that runs a mode
    from gpushare.sim.apidouble import Recorded

NODE_PREFIX = "node-"
CARDS = 8
UNITS = 320  # 80 GiB of 256 MiB units
POD_UNITS = 40
POD_MINUTES = 2.5
WRITES = ("PATCH", "PUT", "POST")
#: kubelet's own writes per node per minute, for comparison (Kubernetes defaults):
#: the Node's status every nodeStatusReportFrequency (5 min) unless it changes, the
#: node Lease every 10 s (renewInterval: a quarter of the 40 s lease).
KUBELET_NODE_PER_MINUTE = 0.2
KUBELET_LEASE_PER_MINUTE = 6.0


def _scale(speed: float) -> None:
    """Divide every interval of the link by ``speed`` (before any link is made)."""
    from gpushare.kube import apilink

    for name in (
        "DEBOUNCE_SECONDS",
        "PUBLISH_SETTLE_SECONDS",
        "MIN_PUBLISH_INTERVAL",
        "REFRESH_SECONDS",  # the forced rewrite of releases before the state object
        "RESYNC_SECONDS",
    ):
        if hasattr(apilink, name):
            setattr(apilink, name, getattr(apilink, name) / speed)


def _node(index: int) -> dict[str, Any]:
    name = f"{NODE_PREFIX}{index:04d}"
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {}}}


class _Node:
    """One node's link and the units its pods hold, driven from the bench's thread."""

    def __init__(self, index: int, mode: str) -> None:
        from gpushare.gpu.gpus import Gpu
        from gpushare.gpu.health import HealthBoard
        from gpushare.kube.apilink import ApiLink
        from gpushare.kube.podspecs import PodSpecBook
        from gpushare.share.devices import Inventory
        from gpushare.share.usage import UsageLedger

        self.name = f"{NODE_PREFIX}{index:04d}"
        gpus = [
            Gpu(f"GPU-{index:05d}-{c:02d}-5f2a-4c3e-9b1d-000000000000", "A100", 81920, c, c)
            for c in range(CARDS)
        ]
        self.inventory = Inventory(gpus, 256)
        self.usage = UsageLedger(self.inventory)
        extra: dict[str, Any] = {} if mode == "legacy" else {"state_mode": mode}
        self.link = ApiLink(
            self.name,
            "gpushare.io",
            self.inventory,
            self.usage,
            HealthBoard([g.uuid for g in gpus]),
            PodSpecBook("gpushare.io"),
            lambda: None,
            **extra,
        )
        self.cards = [g.uuid for g in gpus]
        self.held: dict[str, dict[str, set[int]]] = {}  # pod -> card -> memory units

    def _replace(self) -> None:
        from gpushare.share.devices import Resource

        memory: dict[str, set[int]] = {uuid: set() for uuid in self.cards}
        for by_card in self.held.values():
            for uuid, numbers in by_card.items():
                memory[uuid] |= numbers
        none: dict[str, set[int]] = {u: set() for u in self.cards}
        used: dict[Resource, Mapping[str, Iterable[int]]] = {
            Resource.MEMORY: memory,
            Resource.CORE: none,
        }
        self.usage.replace(used, {}, time.monotonic())
        self.link.notify_changed()

    def start_pod(self, pod: str) -> None:
        for uuid in self.cards:
            taken = {n for by_card in self.held.values() for n in by_card.get(uuid, ())}
            free = [n for n in range(UNITS) if n not in taken]
            if len(free) >= POD_UNITS:
                self.held[pod] = {uuid: set(free[:POD_UNITS])}
                break
        self._replace()

    def end_pod(self, pod: str) -> None:
        self.held.pop(pod, None)
        self._replace()


def run_mode(
    mode: str, nodes: int, per_minute: float, minutes: float, speed: float
) -> dict[str, Any]:
    """Count the writes of ``nodes`` links in ``mode`` over ``minutes`` simulated minutes
    at ``per_minute`` pods started per node per minute."""
    from gpushare.sim.apidouble import KubeApiDouble

    _scale(speed)
    api = KubeApiDouble()
    api.start()
    folder = Path(tempfile.mkdtemp(prefix="gs-writes-"))
    os.environ["KUBECONFIG"] = str(api.kubeconfig(folder / "kubeconfig"))
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    os.environ["POD_NAMESPACE"] = "gpushare"
    for i in range(nodes):
        api.add(_node(i))
    driven = [_Node(i, mode) for i in range(nodes)]
    for node in driven:
        node.link.start()
    deadline = time.monotonic() + 120
    while any(n.link.publishes < 1 for n in driven) and time.monotonic() < deadline:
        time.sleep(0.05)
    # warm-up: the pods of one lifetime, then count
    minute = 60.0 / speed
    events = _pod_events(nodes, per_minute, minutes, minute)
    began = time.monotonic()
    warm = POD_MINUTES * minute if per_minute > 0 else minute
    counted_from: int | None = None
    window_start = 0.0
    stop = began + warm + minutes * minute
    events = sorted(e for e in events if e[0] < stop - began)
    for at, i, what, pod in [*events, (stop - began, -1, "", "")]:
        now = time.monotonic() - began
        if counted_from is None and at >= warm:
            time.sleep(max(0.0, warm - now))
            counted_from = len(api.requests)
            window_start = time.monotonic()
            now = time.monotonic() - began
        if at > now:
            time.sleep(at - now)
        if i < 0:
            break
        getattr(driven[i], f"{what}_pod")(pod)
    if counted_from is None:
        counted_from = len(api.requests)
        window_start = time.monotonic()
        time.sleep(max(0.0, stop - time.monotonic()))
    elapsed = (time.monotonic() - window_start) / minute
    writes = [r for r in api.requests[counted_from:] if r.method in WRITES]
    for node in driven:
        threading.Thread(target=node.link.stop, daemon=True).start()
    api.stop()
    return _rates(mode, nodes, per_minute, elapsed, writes)


def _pod_events(
    nodes: int, per_minute: float, minutes: float, minute: float
) -> list[tuple[float, int, str, str]]:
    """(seconds from the start, node, ``start`` or ``end``, pod) of every pod started
    ``per_minute`` times a simulated minute on each node, spread over the nodes, each
    living :data:`POD_MINUTES`, for the warm-up and ``minutes`` after it (unsorted)."""
    events: list[tuple[float, int, str, str]] = []
    if per_minute > 0:
        gap = minute / per_minute
        horizon = (minutes + POD_MINUTES) * minute
        for i in range(nodes):
            offset = gap * i / nodes
            k = 0
            while offset + k * gap < horizon:
                at = offset + k * gap
                events.append((at, i, "start", f"p{k}"))
                events.append((at + POD_MINUTES * minute, i, "end", f"p{k}"))
                k += 1
    return events


def _rates(
    mode: str, nodes: int, per_minute: float, elapsed: float, writes: list[Recorded]
) -> dict[str, Any]:
    """The writes counted over ``elapsed`` simulated minutes, per node and minute: to
    Nodes, to state objects, the rest, and a Node patch's mean size."""
    per = nodes * elapsed
    node_writes = sum(1 for r in writes if r.path.startswith("/api/v1/nodes/"))
    object_writes = sum(
        1 for r in writes if "/configmaps/" in r.path or r.path.endswith("/configmaps")
    )
    node_bytes = sum(len(json.dumps(r.body)) for r in writes if r.path.startswith("/api/v1/nodes/"))
    return {
        "mode": mode,
        "nodes": nodes,
        "pods_per_minute": per_minute,
        "minutes": round(elapsed, 2),
        "node_per_minute": node_writes / per,
        "object_per_minute": object_writes / per,
        "other_per_minute": (len(writes) - node_writes - object_writes) / per,
        "node_patch_bytes": node_bytes // max(1, node_writes),
    }


def _child(src: str | None, args: list[str]) -> dict[str, Any]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    # run by path: the baseline's src/ has no such module
    code = (
        "import runpy, sys; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    command = [sys.executable, "-c", code, __file__, "--child", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| daemon | pods/min/node | Node writes/min/node | state-object writes/min/node "
        "| bytes per Node PATCH body |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        name = {
            "legacy": "before (annotation, rewritten every 30 s)",
            "annotation": "`--node-state annotation`",
            "both": "`--node-state both` (default, rollout)",
            "object": "`--node-state object`",
        }[row["mode"]]
        lines.append(
            f"| {name} | {row['pods_per_minute']:g} | {row['node_per_minute']:.2f} "
            f"| {row['object_per_minute']:.2f} | {row['node_patch_bytes'] or '-'} |"
        )
    lines.append(
        f"| kubelet (reference, defaults) | - | {KUBELET_NODE_PER_MINUTE:g} (status) "
        f"| {KUBELET_LEASE_PER_MINUTE:g} (its Lease) | - |"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare.bench.writes")
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=6.0, help="simulated minutes counted")
    parser.add_argument("--speed", type=float, default=20.0, help="simulated seconds per second")
    parser.add_argument("--rates", default="0,1", help="pods per node per minute, comma-separated")
    parser.add_argument("--modes", default="annotation,both,object")
    parser.add_argument("--baseline-src", default="", help="src/ of the release before")
    parser.add_argument("--out", default="bench-out/writes.md")
    parser.add_argument("--write", default="", help="replace the writes table of this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        row = run_mode(args.mode, args.nodes, args.rate, args.minutes, args.speed)
        print(json.dumps(row))
        return 0
    common = ["--nodes", str(args.nodes), "--minutes", str(args.minutes)]
    common += ["--speed", str(args.speed)]
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        runs = [("legacy", args.baseline_src)] if args.baseline_src else []
        runs += [(mode, "") for mode in args.modes.split(",")]
        for mode, src in runs:
            row = _child(src or None, [*common, "--mode", mode, "--rate", str(rate)])
            print(json.dumps(row), flush=True)
            rows.append(row)
    lines = table(rows)
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    if args.write:
        target = Path(args.write)
        doc = target.read_text()
        begin, end = "<!-- writes table -->", "<!-- /writes table -->"
        head, _, rest = doc.partition(begin)
        _, _, tail = rest.partition(end)
        target.write_text(f"{head}{begin}\n{text}{end}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
