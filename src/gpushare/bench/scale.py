"""``python -m gpushare.bench.scale``: the scheduler extender at cluster scale.

What it measures, against a real ``gpushare-scheduler-extender`` process:

- filter and prioritize by node names (``nodeCacheCapable: true``) at N nodes: p50 and
  p99 wall time per request, and the extender's CPU per request (from
  ``/proc/<pid>/stat``, so a loaded machine shows in the wall time, not in the CPU);
- the same with full Node objects (the older configuration) where the body fits,
  and the body size both ways;
- the extender's start at P pods: time from launch to ``/readyz`` 200, the pod lists
  it made, and its peak RSS (``VmHWM``).

The API side is a stand-in: a small HTTP server that answers the extender's paged pod
and node lists from pre-built JSON (realistic objects: a ~6 KB Pod with managed fields
and status, a Node with a realistic status and 8 cards in the daemon's annotation,
``nodestate.encode``) and holds its watches open. It is not kube-apiserver: it measures
the extender's side (parsing, memory, the verbs), not the API server's. The table goes
to ``bench-out/scale.md`` and, with ``--write FILE``, replaces the ``## Scale`` section
of FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from gpushare.kube import nodestate

PREFIX = "gpushare.io"
CARDS = 8
PAGE_LIMIT = 500
TICK = os.sysconf("SC_CLK_TCK")


def gpu_node(index: int) -> dict[str, Any]:
    """A Node as the API server sends it: labels, a realistic status, and the daemon's
    card state for 8 A100s with a few pods counted per card."""
    name = f"node-{index:05d}"
    cards = tuple(
        nodestate.CardState(
            uuid=f"GPU-{index:05d}-{c:02d}-5f2a-4c3e-9b1d-000000000000",
            index=c,
            name="NVIDIA A100-SXM4-80GB",
            memory_mib=81920,
            memory_units=320,
            memory_units_used=64 * (c % 4),
            core_units=100,
            core_units_used=25 * (c % 4),
            healthy=True,
            pods=tuple((f"default/pod-{index}-{c}-{p}", 64, 25) for p in range(c % 4)),
        )
        for c in range(CARDS)
    )
    state = nodestate.NodeGpuState(7, "2026-11-27T05:00:00Z", 256, cards)
    images = [
        {"names": [f"registry.example.com/team/image-{i}@sha256:{'ab' * 32}"], "sizeBytes": 10**9}
        for i in range(20)
    ]
    amounts = {
        "cpu": "96",
        "memory": "1056561908Ki",
        "pods": "110",
        "ephemeral-storage": "3750000000Ki",
        f"{PREFIX}/vcuda-memory": str(320 * CARDS),
        f"{PREFIX}/vcuda-core": str(100 * CARDS),
    }
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": f"7d1c{index:08d}-0000-4000-8000-000000000000",
            "resourceVersion": "1",
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "node.kubernetes.io/instance-type": "p4d.24xlarge",
                "topology.kubernetes.io/zone": "zone-a",
                f"{PREFIX}/gpu": "true",
            },
            "annotations": {
                nodestate.annotation_key(PREFIX): nodestate.encode(state),
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
        },
        "spec": {"podCIDR": "10.0.0.0/24", "providerID": f"aws:///zone-a/i-{index:017d}"},
        "status": {
            "capacity": amounts,
            "allocatable": amounts,
            "conditions": [
                {
                    "type": kind,
                    "status": "False" if kind != "Ready" else "True",
                    "lastHeartbeatTime": "2026-11-27T05:00:00Z",
                    "lastTransitionTime": "2026-11-20T05:00:00Z",
                    "reason": f"Kubelet{kind}",
                    "message": f"kubelet reports {kind}",
                }
                for kind in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
            ],
            "addresses": [
                {"type": "InternalIP", "address": "10.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "kubeletVersion": "v1.36.3",
                "containerRuntimeVersion": "containerd://2.1.0",
                "osImage": "Ubuntu 24.04 LTS",
                "kernelVersion": "6.8.0",
                "architecture": "amd64",
            },
            "images": images,
        },
    }


def a_pod(index: int, gpu: bool, node: str = "") -> dict[str, Any]:
    """A ~6 KB Pod as the API server lists it (managed fields, env, status)."""
    name = f"pod-{index:06d}"
    limits: dict[str, str] = {"cpu": "2", "memory": "4Gi"}
    if gpu:
        limits[f"{PREFIX}/vcuda-memory"] = "16"
        limits[f"{PREFIX}/vcuda-core"] = "10"
    env = [{"name": f"SETTING_{i}", "value": "x" * 40} for i in range(12)]
    return {
        "metadata": {
            "name": name,
            "namespace": f"team-{index % 50}",
            "uid": f"{index:08d}-1111-4000-8000-000000000000",
            "resourceVersion": str(1000 + index),
            "creationTimestamp": "2026-11-27T05:00:00Z",
            "labels": {"app": f"app-{index % 300}", "pod-template-hash": "5d8f7c9b6d"},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": f"app-{index % 300}",
                    "uid": "0000",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "managedFields": [
                {
                    "manager": "kube-controller-manager",
                    "operation": "Update",
                    "apiVersion": "v1",
                    "time": "2026-11-27T05:00:00Z",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {
                        "f:metadata": {"f:labels": {"f:app": {}}},
                        "f:spec": {
                            "f:containers": {
                                'k:{"name":"main"}': {
                                    ".": {},
                                    "f:env": {},
                                    "f:image": {},
                                    "f:resources": {},
                                }
                            }
                        },
                    },
                },
                {
                    "manager": "kubelet",
                    "operation": "Update",
                    "apiVersion": "v1",
                    "time": "2026-11-27T05:00:01Z",
                    "fieldsType": "FieldsV1",
                    "subresource": "status",
                    "fieldsV1": {
                        "f:status": {
                            "f:conditions": {},
                            "f:containerStatuses": {},
                            "f:hostIP": {},
                            "f:phase": {},
                            "f:podIP": {},
                        }
                    },
                },
            ],
        },
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "registry.example.com/team/app:1.2.3",
                    "env": env,
                    "resources": {"limits": limits, "requests": limits},
                    "volumeMounts": [
                        {
                            "name": "kube-api-access",
                            "readOnly": True,
                            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                        }
                    ],
                    "terminationMessagePath": "/dev/termination-log",
                    "imagePullPolicy": "IfNotPresent",
                }
            ],
            "nodeName": node,
            "restartPolicy": "Always",
            "schedulerName": "gpushare-scheduler" if gpu else "default-scheduler",
            "serviceAccountName": "default",
            "tolerations": [
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                }
            ],
            "volumes": [
                {
                    "name": "kube-api-access",
                    "projected": {
                        "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}
                        ]
                    },
                }
            ],
        },
        "status": {
            "phase": "Running",
            "hostIP": "10.0.0.1",
            "podIP": "10.1.0.1",
            "startTime": "2026-11-27T05:00:00Z",
            "conditions": [
                {"type": t, "status": "True", "lastTransitionTime": "2026-11-27T05:00:00Z"}
                for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
            ],
            "containerStatuses": [
                {
                    "name": "main",
                    "ready": True,
                    "restartCount": 0,
                    "image": "registry.example.com/team/app:1.2.3",
                    "imageID": f"registry.example.com/team/app@sha256:{'cd' * 32}",
                    "containerID": f"containerd://{'ef' * 32}",
                    "state": {"running": {"startedAt": "2026-11-27T05:00:01Z"}},
                }
            ],
        },
    }


def _pod_template(gpu: bool) -> str:
    """:func:`a_pod` as a %-template of what varies with the index (one json.dumps, not
    one per pod: the stand-in shares the cores with the extender it measures)."""
    pod = a_pod(0, gpu, "@node@")
    meta = pod["metadata"]
    meta.update(name="@name@", namespace="@namespace@", uid="@uid@", resourceVersion="@rv@")
    meta["labels"]["app"] = "@app@"
    meta["ownerReferences"][0]["name"] = "@app@"
    text = json.dumps(pod).replace("%", "%%")
    for field in ("node", "name", "namespace", "uid", "rv", "app"):
        text = text.replace(f"@{field}@", f"%({field})s")
    return text


def _pod_fields(index: int, node: str) -> dict[str, str]:
    return {
        "node": node,
        "name": f"pod-{index:06d}",
        "namespace": f"team-{index % 50}",
        "uid": f"{index:08d}-1111-4000-8000-000000000000",
        "rv": str(1000 + index),
        "app": f"app-{index % 300}",
    }


_POD_TEXT = {gpu: _pod_template(gpu) for gpu in (False, True)}


class ListStandIn:
    """Answers ``GET /api/v1/pods`` and ``/api/v1/nodes`` lists in pages of pre-built
    JSON, and holds every watch open (no events) until :meth:`stop`."""

    def __init__(self, nodes: int, pods: int, gpu_every: int = 4, prerender: bool = False) -> None:
        self.nodes = nodes
        self.pods = pods
        self.gpu_every = gpu_every
        self.lists: dict[str, int] = {"pods": 0, "nodes": 0}
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        #: pages of pods rendered before the extender starts (its start then measures the
        #: extender, not this process building JSON on the same cores)
        self._pages: dict[tuple[int, int], bytes] = {}
        if prerender:
            for start in range(0, pods, PAGE_LIMIT):
                self._pages[(start, PAGE_LIMIT)] = self.page("pods", start, PAGE_LIMIT)

    def _node(self, index: int) -> bytes:
        return json.dumps(gpu_node(index)).encode()

    def _pod(self, index: int) -> bytes:
        gpu = index % self.gpu_every == 0
        node = f"node-{index % max(self.nodes, 1):05d}"
        return (_POD_TEXT[gpu] % _pod_fields(index, node)).encode()

    def page(self, kind: str, start: int, limit: int) -> bytes:
        ready = self._pages.get((start, limit)) if kind == "pods" else None
        if ready is not None:
            return ready
        total = self.pods if kind == "pods" else self.nodes
        end = min(total, start + limit)
        build = self._pod if kind == "pods" else self._node
        items = b",".join(build(i) for i in range(start, end))
        meta: dict[str, str] = {"resourceVersion": "5000"}
        if end < total:
            meta["continue"] = str(end)
        head = f'{{"kind":"List","apiVersion":"v1","metadata":{json.dumps(meta)},"items":['
        return head.encode() + items + b"]}"

    def start(self) -> str:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                parsed = urlparse(self.path)
                query = parse_qs(parsed.query)
                kind = parsed.path.rstrip("/").rsplit("/", 1)[-1]
                if kind not in ("pods", "nodes"):
                    self.send_error(404)
                    return
                if (query.get("watch") or [""])[0] in ("1", "true"):
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.flush()
                    outer._stop.wait()
                    return
                start = int((query.get("continue") or ["0"])[0])
                if start == 0:
                    outer.lists[kind] += 1
                limit = int((query.get("limit") or [str(PAGE_LIMIT)])[0])
                body = outer.page(kind, start, limit)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Extender:
    """``gpushare-scheduler-extender`` as a process against the stand-in."""

    def __init__(self, api: str) -> None:
        self.port = _free_port()
        command = [
            sys.executable,
            "-m",
            "gpushare.extender",
            "--address",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--api-server",
            api,
            "--token-file",
            "",
            "--ca-file",
            "",
            "--log-level",
            "warning",
        ]
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, limit: float = 900.0) -> float:
        """Seconds from launch to /readyz 200."""
        while time.perf_counter() - self.started < limit:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the extender exited: {self.proc.stderr.read()[-2000:]!r}")  # type: ignore[union-attr]
            try:
                with urllib.request.urlopen(self.url("/readyz"), timeout=5) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError("the extender was not ready in time")

    def post(self, verb: str, body: bytes) -> tuple[int, float, float]:
        """(status, wall seconds, the extender's CPU seconds) of one request."""
        request = urllib.request.Request(
            self.url(f"/gpushare/{verb}"),
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        cpu = _cpu_seconds(self.proc.pid)
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                answer.read()
                status = answer.status
        except urllib.error.HTTPError as error:
            status = error.code
        wall = time.perf_counter() - started
        return status, wall, _cpu_seconds(self.proc.pid) - cpu

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def scheduler_sends(nodes: int) -> int:
    """How many nodes kube-scheduler passes to an extender's filter at its default
    ``percentageOfNodesToScore`` (adaptive: 50 % less 1 % per 125 nodes, at least 5 %;
    at least 100 nodes): it stops looking once it has found that many feasible ones."""
    if nodes < 100:
        return nodes
    percentage = max(5.0, 50 - nodes / 125)
    return max(100, int(nodes * percentage / 100))


def _pending_pod(index: int, memory_units: int = 16) -> dict[str, Any]:
    pod = a_pod(index, gpu=True)
    pod["spec"]["nodeName"] = ""
    pod["status"] = {"phase": "Pending"}
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    limits[f"{PREFIX}/vcuda-memory"] = str(memory_units)
    return pod


def measure_verbs(
    nodes: int, requests: int, full_nodes: bool, sent: int | None = None, shapes: bool = False
) -> dict[str, Any]:
    """Filter and prioritize in a cluster of ``nodes`` nodes, over ``sent`` of them
    (all by default), by names (or full Nodes). The same pod every request, or with
    ``shapes`` a pod of a shape not asked before in each (every node's verdict is then
    computed, none is taken from the extender's verdict cache)."""
    sent = nodes if sent is None else sent
    stand_in = ListStandIn(nodes, pods=0)
    api = stand_in.start()
    extender = Extender(api)
    try:
        extender.wait_ready()
        body: dict[str, Any] = {"Pod": _pending_pod(999_999)}
        if full_nodes:
            body["Nodes"] = {"items": [gpu_node(i) for i in range(sent)]}
        else:
            body["NodeNames"] = [f"node-{i:05d}" for i in range(sent)]
        raw = json.dumps(body).encode()
        way = f"{sent} {'full Nodes' if full_nodes else 'names'}"
        row: dict[str, Any] = {
            "nodes": nodes,
            "way": way + (", a new pod shape each request" if shapes else ""),
            "body_kb": len(raw) / 1024,
        }
        asked = 0
        for verb in ("filter", "prioritize"):
            walls, cpus, statuses = [], [], set()
            for _ in range(requests):
                if shapes:  # 17, 18, ... units: every node still holds it
                    asked += 1
                    body["Pod"] = _pending_pod(asked, 16 + asked)
                    raw = json.dumps(body).encode()
                status, wall, cpu = extender.post(verb, raw)
                statuses.add(status)
                walls.append(wall)
                cpus.append(cpu)
            row[verb] = {
                "status": sorted(statuses),
                "p50_ms": 1000 * statistics.median(walls),
                "p99_ms": 1000 * _pct(walls, 0.99),
                "cpu_ms": 1000 * sum(cpus) / len(cpus),
            }
        return row
    finally:
        extender.stop()
        stand_in.stop()


def measure_start(pods: int, nodes: int) -> dict[str, Any]:
    stand_in = ListStandIn(nodes, pods, prerender=True)
    api = stand_in.start()
    extender = Extender(api)
    try:
        ready = extender.wait_ready()
        return {
            "pods": pods,
            "ready_s": ready,
            "rss_mb": _peak_rss_mb(extender.proc.pid),
            "cpu_s": _cpu_seconds(extender.proc.pid),
            "pod_lists": stand_in.lists["pods"],
        }
    finally:
        extender.stop()
        stand_in.stop()


def table(verbs: list[dict[str, Any]], starts: list[dict[str, Any]]) -> Iterator[str]:
    yield (
        "| cluster nodes | nodes in the request | body KB | filter p50 / p99 ms | "
        "filter CPU ms | prioritize p50 / p99 ms | prioritize CPU ms |"
    )
    yield "|---|---|---|---|---|---|---|"
    for row in verbs:
        f, p = row["filter"], row["prioritize"]
        bad = "" if f["status"] == [200] else f" (HTTP {f['status']})"
        yield (
            f"| {row['nodes']} | {row['way']}{bad} | {row['body_kb']:.0f} | "
            f"{f['p50_ms']:.1f} / {f['p99_ms']:.1f} | {f['cpu_ms']:.1f} | "
            f"{p['p50_ms']:.1f} / {p['p99_ms']:.1f} | {p['cpu_ms']:.1f} |"
        )
    yield ""
    yield "| pods listed | ready s | peak RSS MB | CPU s | pod lists |"
    yield "|---|---|---|---|---|"
    for row in starts:
        yield (
            f"| {row['pods']} | {row['ready_s']:.1f} | {row['rss_mb']:.0f} | "
            f"{row['cpu_s']:.1f} | {row['pod_lists']} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare.bench.scale", description=__doc__)
    parser.add_argument("--nodes", default="100,1000,5000", help="node counts, comma-separated")
    parser.add_argument("--full-nodes", default="100", help="node counts also sent as full Nodes")
    parser.add_argument("--pods", default="10000,50000,150000", help="pod counts for the start")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--out", default="bench-out/scale.md")
    parser.add_argument("--write", default="", help="also replace the ## Scale section here")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",") if n]
    full = [int(n) for n in args.full_nodes.split(",") if n]
    verbs = []
    for nodes in counts:
        default = scheduler_sends(nodes)
        plans = [(True, default, False)] if nodes in full else []
        plans += [(False, default, False), (False, default, True)]
        if default != nodes:
            plans += [(False, nodes, False), (False, nodes, True)]
        for as_full, sent, shapes in plans:
            verbs.append(measure_verbs(nodes, args.requests, as_full, sent, shapes))
            print(json.dumps(verbs[-1]), flush=True)
    starts = []
    for pods in [int(p) for p in args.pods.split(",") if p]:
        starts.append(measure_start(pods, nodes=max(counts)))
        print(json.dumps(starts[-1]), flush=True)
    lines = "\n".join(table(verbs, starts)) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(lines)
    print(lines)
    if args.write:
        _write_section(Path(args.write), lines)
    return 0


def _write_section(path: Path, lines: str) -> None:
    """Replace the tables between the ``scale table`` markers (the prose around them
    stays), else the whole ``## Scale`` section, else append one."""
    text = path.read_text() if path.exists() else ""
    start, end = "<!-- scale table -->\n", "<!-- /scale table -->"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        path.write_text(before + start + lines + end + rest.split(end, 1)[1])
        return
    head = "## Scale (`make scale`)"
    section = f"{head}\n\n{lines}"
    if head in text:
        before, rest = text.split(head, 1)
        after = rest.split("\n## ", 1)
        text = before + section + ("\n## " + after[1] if len(after) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
