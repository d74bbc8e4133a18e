"""``python -m gpushare.bench.scale``: the scheduler extender at cluster scale.

What it measures, against a real ``gpushare-scheduler-extender`` process:

- filter and prioritize by node names (``nodeCacheCapable: true``) at N nodes: p50 and
  p99 wall time per request, and the extender's CPU per request (from
  ``/proc/<pid>/stat``, so a loaded machine shows in the wall time, not in the CPU);
- the same with full Node objects (the older configuration) where the body fits,
  and the body size both ways;
- the extender's start at P pods: time from launch to ``/readyz`` 200, the pod lists
  it made (its ``pods_listed`` log events), its CPU and peak RSS (``VmHWM``).

The API server (``--api``): ``real`` is etcd and kube-apiserver from ``e2e/bin`` (the
binaries ``make e2e`` builds), loaded by :mod:`gpushare.bench.scaleload` with fake Nodes
(realistic status, 8 A100s in the daemon's annotation and state object) and bound Pods,
no kubelets; the time each load step took is in the table. ``stand-in`` is
:mod:`gpushare.bench.scalestandin` (pre-built JSON, not kube-apiserver); ``auto`` (the
default) takes the real one where the binaries are, and says which in the table. The
table goes to ``bench-out/scale.md`` and, with ``--write FILE``, replaces the
``## Scale`` tables of FILE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.bench.scaleobjects import gpu_node, node_name, pending_pod
from gpushare.bench.scalestandin import ListStandIn
from gpushare.sim import controlplane

TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ApiTarget:
    """Where the extender finds its API server, and with which credentials."""

    url: str
    token_file: str = ""
    ca_file: str = ""


@dataclass
class Results:
    api: str = ""
    verbs: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    setup: list[dict[str, Any]] = field(default_factory=list)


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
    """``gpushare-scheduler-extender`` as a process against ``api``; its JSON log in
    ``log``."""

    def __init__(self, api: ApiTarget, log: Path, src: str = "") -> None:
        """``src``: run the extender of another checkout's ``src/`` (a baseline)."""
        self.port = _free_port()
        self.log = log
        command = [
            sys.executable,
            "-m",
            "gpushare.extender",
            "--address",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--api-server",
            api.url,
            "--token-file",
            api.token_file,
            "--ca-file",
            api.ca_file,
            "--state-namespace",
            "kube-system",
            "--log-format",
            "json",
            "--log-level",
            "info",
        ]
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out = log.open("wb")
        self.started = time.perf_counter()
        env = dict(os.environ)
        if src:
            env["PYTHONPATH"] = src
        self.proc = subprocess.Popen(
            command, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )

    def events(self, name: str, key: str) -> list[Any]:
        """``key`` of each ``name`` event the extender logged so far."""
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and event.get("event") == name and key in event:
                    found.append(event[key])
        return found

    def wait_logged(self, name: str, key: str, limit: float = 60.0) -> list[Any]:
        """The ``name`` events once one is logged (its feed thread logs it just after
        the ready state it reports, so it may come a moment after /readyz)."""
        deadline = time.monotonic() + limit
        while not (found := self.events(name, key)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, limit: float = 900.0) -> float:
        """Seconds from launch to /readyz 200."""
        while time.perf_counter() - self.started < limit:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the extender exited: {tail}")
            try:
                with urllib.request.urlopen(self.url("/readyz"), timeout=5) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError("the extender was not ready in time")

    def post(self, verb: str, body: bytes) -> tuple[int, float, float, dict[str, Any]]:
        """(status, wall seconds, the extender's CPU seconds, its answer) of one request."""
        request = urllib.request.Request(
            self.url(f"/gpushare/{verb}"),
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        cpu = _cpu_seconds(self.proc.pid)
        started = time.perf_counter()
        data = b""
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                data = answer.read()
                status = answer.status
        except urllib.error.HTTPError as error:
            status = error.code
        wall = time.perf_counter() - started
        cpu = _cpu_seconds(self.proc.pid) - cpu
        try:
            parsed = json.loads(data) if data else {}
        except ValueError:
            parsed = {}
        return status, wall, cpu, parsed if isinstance(parsed, dict) else {}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


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


def measure_verbs(
    api: ApiTarget,
    work: Path,
    nodes: int,
    requests: int,
    full_nodes: bool,
    sent: int | None = None,
    shapes: bool = False,
) -> dict[str, Any]:
    """Filter and prioritize in a cluster of ``nodes`` nodes (served by ``api``), over
    ``sent`` of them (all by default), by names (or full Nodes). The same pod every
    request, or with ``shapes`` a pod of a shape not asked before in each (every node's
    verdict is then computed, none is taken from the extender's verdict cache)."""
    sent = nodes if sent is None else sent
    extender = Extender(api, work / f"extender-verbs-{nodes}-{sent}.log")
    try:
        extender.wait_ready()
        body: dict[str, Any] = {"Pod": pending_pod(999_999)}
        if full_nodes:
            body["Nodes"] = {"items": [gpu_node(i) for i in range(sent)]}
        else:
            body["NodeNames"] = [node_name(i) for i in range(sent)]
        raw = json.dumps(body).encode()
        way = f"{sent} {'full Nodes' if full_nodes else 'names'}"
        row: dict[str, Any] = {
            "nodes": nodes,
            "way": way + (", a new pod shape each request" if shapes else ""),
            "body_kb": len(raw) / 1024,
        }
        asked = 0
        for verb in ("filter", "prioritize"):
            walls, cpus, statuses, kept = [], [], set(), set()
            for _ in range(requests):
                if shapes:  # 17, 18, ... units: every node still holds it
                    asked += 1
                    body["Pod"] = pending_pod(asked, 16 + asked)
                    raw = json.dumps(body).encode()
                status, wall, cpu, answer = extender.post(verb, raw)
                statuses.add(status)
                walls.append(wall)
                cpus.append(cpu)
                if verb == "filter" and status == 200:
                    kept.add(_kept(answer))
            # the first request after the start also builds every node's counts (it
            # is the slowest once in an extender's life): shown apart
            warm = walls[1:] or walls
            row[verb] = {
                "status": sorted(statuses),
                "first_ms": 1000 * walls[0],
                "p50_ms": 1000 * statistics.median(warm),
                "p99_ms": 1000 * _pct(warm, 0.99),
                "cpu_ms": 1000 * sum(cpus) / len(cpus),
            }
            if verb == "filter":
                row["kept"] = sorted(kept)
        return row
    finally:
        extender.stop()


def _kept(answer: dict[str, Any]) -> int:
    """How many nodes a filter answer keeps (by names or as Nodes)."""
    names = answer.get("NodeNames")
    if isinstance(names, list):
        return len(names)
    nodes = answer.get("Nodes")
    items = nodes.get("items") if isinstance(nodes, dict) else None
    return len(items) if isinstance(items, list) else 0


def measure_start(
    api: ApiTarget, work: Path, pods: int, src: str = "", state_objects: bool = False
) -> dict[str, Any]:
    """The extender's start against ``api`` holding ``pods`` pods (``state_objects``:
    the API server serves the nodes' state objects; their count is read too)."""
    name = f"extender-start-{pods}{'-baseline' if src else ''}.log"
    extender = Extender(api, work / name, src)
    try:
        ready = extender.wait_ready()
        rss, cpu = _peak_rss_mb(extender.proc.pid), _cpu_seconds(extender.proc.pid)
        lists = extender.wait_logged("pods_listed", "pods")
        encodings = extender.events("pods_listed", "encoding")  # none from an older extender
        objects = (
            extender.wait_logged("node_state_objects_listed", "objects") if state_objects else []
        )
        return {
            "pods": pods,
            "extender": "baseline" if src else "",
            "ready_s": ready,
            "rss_mb": rss,
            "cpu_s": cpu,
            "pod_lists": len(lists),
            "gpu_pods": lists,
            "encodings": encodings,
            "state_objects": objects,
        }
    finally:
        extender.stop()


def verb_plans(nodes: int, full: list[int]) -> list[tuple[bool, int, bool]]:
    """(full Nodes?, nodes sent, a new shape each request?) measured at ``nodes``."""
    default = scheduler_sends(nodes)
    plans = [(True, default, False)] if nodes in full else []
    plans += [(False, default, False), (False, default, True)]
    if default != nodes:
        plans += [(False, nodes, False), (False, nodes, True)]
    return plans


def run_stand_in(
    work: Path, counts: list[int], full: list[int], pods: list[int], requests: int
) -> Results:
    results = Results(
        api="the stand-in list server (gpushare.bench.scalestandin), not kube-apiserver"
    )
    for nodes in counts:
        stand_in = ListStandIn(nodes, pods=0)
        api = ApiTarget(stand_in.start())
        try:
            for as_full, sent, shapes in verb_plans(nodes, full):
                results.verbs.append(
                    measure_verbs(api, work, nodes, requests, as_full, sent, shapes)
                )
                print(json.dumps(results.verbs[-1]), flush=True)
        finally:
            stand_in.stop()
    for count in pods:
        stand_in = ListStandIn(max(counts), count, prerender=True)
        api = ApiTarget(stand_in.start())
        try:
            results.starts.append(measure_start(api, work, count))
            print(json.dumps(results.starts[-1]), flush=True)
        finally:
            stand_in.stop()
    return results


def run_real(
    work: Path,
    counts: list[int],
    full: list[int],
    pods: list[int],
    requests: int,
    pod_status: bool,
    baseline_src: str = "",
) -> Results:
    """One real cluster, grown: the nodes step by step (the verbs at each size), then
    the pods over the largest (the start at each count)."""
    from gpushare.bench.scaleload import RealCluster

    version = subprocess.run(
        [str(controlplane.BIN / "kube-apiserver"), "--version"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    results = Results(
        api=f"kube-apiserver + etcd ({version or 'e2e/bin'}; gpushare.bench.scaleload), "
        "fake Nodes and bound Pods, no kubelets"
    )
    cluster = RealCluster(work / "cluster")
    try:
        api = ApiTarget(cluster.server, str(cluster.token_file), str(cluster.ca))
        for nodes in sorted(counts):
            seconds = cluster.grow_nodes(nodes)
            results.setup.append({"what": "nodes", "total": nodes, "seconds": seconds})
            print(json.dumps(results.setup[-1]), flush=True)
            for as_full, sent, shapes in verb_plans(nodes, full):
                results.verbs.append(
                    measure_verbs(api, work, nodes, requests, as_full, sent, shapes)
                )
                print(json.dumps(results.verbs[-1]), flush=True)
        for count in sorted(pods):
            seconds = cluster.grow_pods(count, pod_status)
            results.setup.append({"what": "pods", "total": count, "seconds": seconds})
            print(json.dumps(results.setup[-1]), flush=True)
            if baseline_src:
                results.starts.append(measure_start(api, work, count, baseline_src, True))
                print(json.dumps(results.starts[-1]), flush=True)
            results.starts.append(measure_start(api, work, count, state_objects=True))
            print(json.dumps(results.starts[-1]), flush=True)
    finally:
        cluster.stop()
    return results


def _load() -> str:
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "?"


def _machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model or platform.machine()}, {os.cpu_count()} cores"


def table(results: Results, command: str = "") -> Iterator[str]:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    yield f"API server: {results.api}. Machine: {_machine()}; load average at the end "
    yield f"{_load()} (1/5/15 min); {when}." + (f" Command: `{command}`." if command else "")
    yield ""
    if results.setup:
        yield "| set-up step | objects in the cluster | seconds | objects/s |"
        yield "|---|---|---|---|"
        previous = {"nodes": 0, "pods": 0}
        for step in results.setup:
            made = step["total"] - previous[step["what"]]
            previous[step["what"]] = step["total"]
            rate = made / step["seconds"] if step["seconds"] > 0 else 0.0
            what = "Nodes (+ state ConfigMaps)" if step["what"] == "nodes" else "bound Pods"
            yield f"| {what} | {step['total']} | {step['seconds']:.1f} | {rate:.0f} |"
        yield ""
    yield (
        "| cluster nodes | nodes in the request | body KB | filter first / p50 / p99 ms | "
        "filter CPU ms | nodes kept | prioritize first / p50 / p99 ms | prioritize CPU ms |"
    )
    yield "|---|---|---|---|---|---|---|---|"
    for row in results.verbs:
        f, p = row["filter"], row["prioritize"]
        bad = "" if f["status"] == [200] else f" (HTTP {f['status']})"
        kept = ",".join(str(k) for k in row.get("kept", [])) or "-"
        yield (
            f"| {row['nodes']} | {row['way']}{bad} | {row['body_kb']:.0f} | "
            f"{f['first_ms']:.1f} / {f['p50_ms']:.1f} / {f['p99_ms']:.1f} | {f['cpu_ms']:.1f} | "
            f"{kept} | {p['first_ms']:.1f} / {p['p50_ms']:.1f} / {p['p99_ms']:.1f} | "
            f"{p['cpu_ms']:.1f} |"
        )
    yield ""
    yield "| pods in the cluster | ready s | peak RSS MB | CPU s | pod lists | extender |"
    yield "|---|---|---|---|---|---|"
    for row in results.starts:
        which = "baseline (--baseline-src)" if row.get("extender") else "this checkout"
        yield (
            f"| {row['pods']} | {row['ready_s']:.1f} | {row['rss_mb']:.0f} | "
            f"{row['cpu_s']:.1f} | {row['pod_lists']} | {which} |"
        )


def _ints(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare.bench.scale", description=__doc__)
    parser.add_argument("--nodes", default="100,1000,5000", help="node counts, comma-separated")
    parser.add_argument("--full-nodes", default="100", help="node counts also sent as full Nodes")
    parser.add_argument("--pods", default="10000,50000,150000", help="pod counts for the start")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument(
        "--api",
        choices=("auto", "real", "stand-in"),
        default="auto",
        help="kube-apiserver + etcd from e2e/bin (real), the stand-in list server, or the "
        "real one where its binaries are (auto)",
    )
    parser.add_argument(
        "--pod-status",
        action="store_true",
        help="real API: also write each pod's status as a kubelet would (one more write "
        "per pod; the set-up then takes about 4x as long)",
    )
    parser.add_argument(
        "--baseline-src",
        default="",
        help="real API: also start the extender of this other checkout's src/ at each pod "
        "count (before/after on the same cluster)",
    )
    parser.add_argument("--work", default="", help="where the cluster and logs go (kept)")
    parser.add_argument("--out", default="bench-out/scale.md")
    parser.add_argument("--write", default="", help="also replace the ## Scale tables here")
    args = parser.parse_args(argv)
    counts, full, pods = _ints(args.nodes), _ints(args.full_nodes), _ints(args.pods)
    real = args.api == "real" or (args.api == "auto" and controlplane.available())
    if args.api == "real" and not controlplane.available():
        parser.error(f"no etcd/kube-apiserver in {controlplane.BIN} (make e2e-build builds them)")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gsscale-", dir="/tmp"))
    try:
        if real:
            results = run_real(
                work, counts, full, pods, args.requests, args.pod_status, args.baseline_src
            )
        else:
            results = run_stand_in(work, counts, full, pods, args.requests)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    command = "python -m gpushare.bench.scale " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    lines = "\n".join(table(results, command.strip())) + "\n"
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


if __name__ == "__main__":
    raise SystemExit(main())
