"""``make bench``: the daemon's latency, start time and footprint.

Every figure but the message sizes is taken from the real daemon process
(``python -m gpushare.daemon``) run as the DaemonSet runs it: ``NODE_NAME`` set and its
API link talking to the API-server double (``gpushare.sim.apidouble``, in a process of
its own), metrics on, this node's pod specs watched. It serves a simulated node of H200
cards and is driven over its unix sockets by the simulated kubelet in this process, the
way the kubelet calls it: per container and resource, GetPreferredAllocation with every
free healthy unit, then Allocate, the daemon reading PodResources as pairing needs.
Each admitted container's pod is created on the API server just before its admission
and deleted when it is released, so the pod watch works throughout. The baseline is an
empty unary call (GetDevicePluginOptions) to the same server over the same channel,
interleaved with the measured calls, so both see the same machine load.

Prints one table, each figure beside its target and the baseline, and exits 1 when a
target is missed (2 when the benchmark itself failed). ``--out FILE`` writes the report to
a file of its own (``make bench``: bench-out/bench.md); ``--write PATH`` also puts the
table, with the machine and the command, into PATH's ``bench`` section.
``--quick`` runs a tiny version (two cards, few iterations) for the smoke test; its
figures say nothing about performance.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpushare._proto.deviceplugin.v1beta1 import api_pb2
from gpushare.base.cli import Parser, bounded_float
from gpushare.bench.processes import (
    BIG_CARD_MIB,
    BIG_CARDS,
    CORE,
    H200_MIB,
    KUBELET_LIMIT,
    MEMORY,
    MIB,
    NODE_NAME,
    ApiServer,
    Node,
    end_on_stdin_close,
    node_gpus,
    process_handle,
    temporary_root,
)
from gpushare.bench.report import FULL, QUICK, Plan, Report, ms, percentile
from gpushare.deviceplugin.plugin import device_list_message
from gpushare.host.elf import stand_in
from gpushare.ops.mdsection import replace_section
from gpushare.share.devices import Inventory, Resource
from gpushare.sim.kubeletdouble import AdmissionError

if TYPE_CHECKING:  # the DRA part is imported by the DRA phase only
    from gpushare.dra.part import DraPart
    from gpushare.kube.podwatch import PodWatch

# --------------------------------------------------------------------------- phases


def measure_messages(plan: Plan, report: Report) -> None:
    """Message sizes and serialisation time of the largest messages, in this process."""
    inventory = Inventory(node_gpus(plan.cards, H200_MIB), 256)
    listing = device_list_message(inventory, Resource.MEMORY, lambda _uuid: True)
    times = []
    for _ in range(plan.serialize_reps):
        started = time.perf_counter()
        listing.SerializeToString()
        times.append(time.perf_counter() - started)
    units = len(listing.devices)
    p50, p99 = statistics.median(times), percentile(times, 99)
    report.add(
        f"ListAndWatch message serialised, {plan.cards} x H200 ({units} memory units)",
        f"p50 {ms(p50)}, p99 {ms(p99)}",
        "< 1 ms",
        f"{listing.ByteSize() / 1024:.0f} KiB",
        p99 < 0.001,
    )
    big = Inventory(node_gpus(BIG_CARDS, BIG_CARD_MIB, "192 GiB card"), 256)
    largest = 0
    for resource in Resource:
        message = device_list_message(big, resource, lambda _uuid: False)  # "Unhealthy": longest
        largest = max(largest, message.ByteSize())
    request = api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=[
                    device_id
                    for uuid in big.cards
                    for device_id in big.device_ids(Resource.MEMORY, uuid)
                ],
                allocation_size=1,
            )
        ]
    )
    largest = max(largest, request.ByteSize())
    units = len(request.container_requests[0].available_deviceIDs)
    report.add(
        f"largest message, {BIG_CARDS} x 192 GiB ({units} memory units)",
        f"{largest / MIB:.2f} MiB",
        "well under 4 MiB (the daemon refuses to start above 3 MiB)",
        "",
        largest < KUBELET_LIMIT * 3 // 4,
    )


def measure_start(plan: Plan, report: Report) -> None:
    times = []
    for run in range(plan.runs):
        with temporary_root() as root:
            node = Node(root / f"s{run}", plan.cards)
            try:
                times.append(node.start())
            finally:
                node.stop()
    median = statistics.median(times)
    report.add(
        f"start: process start to both resources registered with their device lists "
        f"({len(times)} runs)",
        f"median {ms(median)}, max {ms(max(times))}",
        "<= 150 ms",
        "",
        median <= 0.150,
    )


@dataclass
class Samples:
    """The daemon's call times, by (resource, method), taken while ``recording``."""

    calls: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    recording: bool = False

    def observe(self, resource: str, method: str, seconds: float) -> None:
        if self.recording:
            self.calls.setdefault((resource, method), []).append(seconds)


class _DaemonUnderTest:
    """The daemon process of :func:`measure_daemon`: containers admitted to it (split
    pairs and failed admissions counted), its call times, its process."""

    def __init__(self, plan: Plan, report: Report, node: Node, samples: Samples) -> None:
        assert node.proc is not None
        self.plan, self.report, self.node, self.samples = plan, report, node, samples
        self.pid = node.proc.pid
        self.process = process_handle(self.pid)
        self.split = self.failures = 0

    def admit(self, count: int, baseline: list[float] | None = None) -> None:
        """Admit ``count`` containers (``baseline``: a bare gRPC call's time before each)."""
        for _ in range(count):
            if baseline is not None:
                baseline.append(self.node.baseline_call())
            try:
                memory_card, core_card = self.node.admit_next(self.plan.window)
            except AdmissionError as exc:
                self.failures += 1
                self.report.notes.append(f"admission failed: {exc}")
                continue
            self.split += memory_card != core_card

    def idle(self) -> tuple[float, float, float]:
        """Seconds watched idle, CPU seconds spent meanwhile, voluntary switches a second."""
        plan = self.plan
        time.sleep(plan.quiet_seconds)
        cpu_before, switches_before = self.process.cpu_times(), wakeups_of(self.pid)
        idle_started = time.monotonic()
        time.sleep(plan.idle_seconds)
        idle = time.monotonic() - idle_started
        cpu_after, switches_after = self.process.cpu_times(), wakeups_of(self.pid)
        busy = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
        return idle, busy, (switches_after - switches_before) / idle

    def latency_runs(self) -> list[dict[str, tuple[float, float]]]:
        """Per run: the median and 99th percentile of the baseline call, the admission
        and each call of the daemon."""
        runs: list[dict[str, tuple[float, float]]] = []
        for _ in range(self.plan.runs):
            self.samples.calls.clear()
            self.node.admissions.clear()
            baseline: list[float] = []
            self.samples.recording = True
            self.admit(self.plan.latency_containers, baseline)
            self.samples.recording = False
            admissions = self.node.admissions
            run = {
                "baseline": (statistics.median(baseline), percentile(baseline, 99)),
                "admission": (statistics.median(admissions), percentile(admissions, 99)),
            }
            for (resource, method), values in self.samples.calls.items():
                run[f"{method} {resource}"] = (statistics.median(values), percentile(values, 99))
            runs.append(run)
        return runs

    def growth_rows(self, rss_started: int) -> None:
        """Memory and descriptors after the long burst of Allocates."""
        plan, report, process = self.plan, self.report, self.process
        fds_before = process.num_fds()
        done = 2 * plan.latency_containers * plan.runs + 4 * plan.window
        self.admit(max(0, plan.allocations - done) // 2)  # two Allocate calls per container
        settle(plan)
        rss_after, fds_after = process.memory_info().rss, process.num_fds()
        report.add(
            f"RSS after {plan.allocations} Allocates",
            f"{rss_after / MIB:.1f} MiB",
            "<= 42 MiB",
            f"{(rss_after - rss_started) / MIB:+.1f} MiB since start",
            rss_after <= 42 * MIB,
        )
        report.add(
            f"open descriptors after {plan.allocations} Allocates",
            f"{fds_after - fds_before:+d}",
            "+0",
            f"{fds_before} before",
            fds_after <= fds_before,
        )

    def idle_rows(self, idle: float, busy: float, wakeups: float) -> None:
        self.report.add(
            f"idle wake-ups over {idle:.0f} s, {self.plan.quiet_seconds:g} s after the warm-up "
            "(voluntary switches, all threads)",
            f"{wakeups:.1f}/s",
            "<= 2/s",
            f"{self.process.num_threads()} threads",
            wakeups <= 2.0,
        )
        self.report.add(
            f"idle CPU over {idle:.0f} s",
            f"{100 * busy / idle:.3f} % of a core",
            "<= 0.02 %",
            "",
            busy / idle <= 0.0002,
        )


def measure_daemon(plan: Plan, report: Report, *, latency_only: bool = False) -> None:
    """The daemon process's rows; ``latency_only``: the call latencies and the pairing
    rows alone (no idle wait, no growth burst: minutes less)."""
    samples = Samples()
    with temporary_root() as root:
        node = Node(root, plan.cards, samples.observe)
        try:
            node.start()
            daemon = _DaemonUnderTest(plan, report, node, samples)
            settle(plan)
            rss_started = daemon.process.memory_info().rss
            if not latency_only:
                report.add(
                    "idle RSS after start (API link, pod watch and metrics on)",
                    f"{rss_started / MIB:.1f} MiB",
                    "<= 40 MiB",
                    "",
                    rss_started <= 40 * MIB,
                )
            daemon.admit(plan.window * 2)  # warm up: channels, caches, a full window
            # Idle once it has served: measured before the long burst below, whose
            # released cache directories the garbage collector removes for minutes after.
            idle = busy = wakeups = 0.0
            if not latency_only:
                idle, busy, wakeups = daemon.idle()
            _latency_rows(plan, report, daemon.latency_runs())
            if latency_only:
                _pairing_rows(report, node, daemon.split, daemon.failures)
                return
            daemon.growth_rows(rss_started)
            _pairing_rows(report, node, daemon.split, daemon.failures)
            daemon.idle_rows(idle, busy, wakeups)
        finally:
            node.stop()


def _pairing_rows(report: Report, node: Node, split: int, failures: int) -> None:
    report.add(
        "containers whose memory and core landed on two cards",
        str(split),
        "0",
        f"{node.serial} admitted",
        split == 0,
    )
    report.add(
        "admissions refused",
        str(failures),
        "0",
        f"{node.serial} admitted",
        failures == 0,
    )
    report.add(
        "pods created and deleted on the API server during the run",
        f"{node.api.pods_created} created, {node.api.pods_deleted} deleted",
        ">= 100 each",
        "",
        min(node.api.pods_created, node.api.pods_deleted) >= min(100, node.serial // 2),
    )


def wakeups_of(pid: int) -> int:
    """Voluntary context switches of all the process's threads (each is a wake-up)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            status = (task / "status").read_text()
            total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def settle(plan: Plan) -> None:
    """Let the refresh that follows a burst of admissions run (debounced, at most 1 s)."""
    time.sleep(min(1.5, plan.idle_seconds * 3))


#: (method, p50 limit, p99 limit) as multiples of the empty call's p50 and p99.
RATIOS = {"Allocate": (1.5, 2.5), "GetPreferredAllocation": (3.0, 4.0)}


def _latency_rows(plan: Plan, report: Report, runs: list[dict[str, tuple[float, float]]]) -> None:
    """Each call's p50 and p99 against the empty call's in the same run (median of runs)."""
    base_p50 = statistics.median(run["baseline"][0] for run in runs)
    base_p99 = statistics.median(run["baseline"][1] for run in runs)
    report.add(
        "baseline: empty unary call (GetDevicePluginOptions)",
        f"p50 {ms(base_p50)}, p99 {ms(base_p99)}",
        "",
        "",
        None,
    )
    units = {MEMORY: f"{plan.cards * (H200_MIB // 256)} IDs", CORE: f"{plan.cards * 100} IDs"}
    for method, (p50_limit, p99_limit) in RATIOS.items():
        for resource in (MEMORY, CORE):
            key = f"{method} {resource}"
            p50 = statistics.median(run[key][0] for run in runs)
            p99 = statistics.median(run[key][1] for run in runs)
            r50 = statistics.median(run[key][0] / run["baseline"][0] for run in runs)
            r99 = statistics.median(run[key][1] / run["baseline"][1] for run in runs)
            offered = f", {units[resource]} offered" if method != "Allocate" else ""
            report.add(
                f"{method} {resource.split('/')[1]} ({plan.cards} x H200{offered})",
                f"p50 {ms(p50)}, p99 {ms(p99)}",
                f"p50 <= {p50_limit:g}x, p99 <= {p99_limit:g}x the empty call",
                f"p50 {r50:.1f}x, p99 {r99:.1f}x",
                r50 <= p50_limit and r99 <= p99_limit,
            )
    p50 = statistics.median(run["admission"][0] for run in runs)
    p99 = statistics.median(run["admission"][1] for run in runs)
    report.add(
        "whole admission (two resources, four calls)",
        f"p50 {ms(p50)}, p99 {ms(p99)}",
        "p50 <= 5 ms",
        f"4 empty calls: {ms(4 * base_p50)}",
        p50 <= 0.005,
    )


# --------------------------------------------------------------------------- DRA


def measure_dra(plan: Plan, report: Report) -> None:
    """NodePrepareResources against one GET of the claim (docs/dra.md), against the
    API-server double (in its own process) and, where ``make e2e`` built them, a real
    kube-apiserver v1.36.3 (TLS, token authentication, RBAC, etcd)."""
    from gpushare.sim import controlplane

    rounds = max(20, plan.latency_containers // 2)
    row = _dra_on_double(plan, rounds)
    # Information only: the double's GET (a dict lookup behind Python's HTTP server) costs
    # less than an empty gRPC call, so 2x of it is no yardstick; the target is the real one.
    report.add(
        f"DRA NodePrepareResources, one share, API-server double ({row[0]}",
        row[1],
        "information (the target is against a real API server)",
        row[3],
        None,
    )
    if not controlplane.available():
        report.notes.append(
            f"DRA prepare against a real kube-apiserver not measured: no binaries in "
            f"{controlplane.BIN} (make e2e builds them; GPUSHARE_E2E_BIN)"
        )
        return
    row = _dra_on_real_server(plan, rounds)
    report.add(f"DRA NodePrepareResources, one share, real kube-apiserver ({row[0]}", *row[1:])


CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


def _dra_on_double(plan: Plan, rounds: int) -> tuple[str, str, str, str, bool]:
    """The DRA rounds against the API-server double, in a process of its own."""
    from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint

    with temporary_root() as root:
        api = ApiServer(root)
        try:
            client = ApiClient(kubeconfig_endpoint(api.kubeconfig))

            def post_double(claim: dict[str, Any], pod: dict[str, Any]) -> str:
                if api.call("POST", "/api/v1/namespaces/default/pods", pod) != 201:
                    raise RuntimeError("the API-server double refused a pod")
                made = client.get(f"/api/v1/namespaces/default/pods/{pod_name(pod)}")
                _reserve(claim, pod, made["metadata"]["uid"])
                if api.call("POST", CLAIMS, claim) != 201:
                    raise RuntimeError("the API-server double refused a claim")
                return str(made["metadata"]["uid"])

            return _dra_rounds(plan, root, client, post_double, rounds)
        finally:
            api.stop()


def _dra_on_real_server(plan: Plan, rounds: int) -> tuple[str, str, str, str, bool]:
    """The DRA rounds against a real kube-apiserver and etcd (``make e2e``'s binaries):
    each claim created as a user would, then allocated as the scheduler writes it."""
    from gpushare.sim import controlplane

    with temporary_root() as root:
        plane = controlplane.ControlPlane(root, {"DRAConsumableCapacity": True}, node=NODE_NAME)
        try:
            plane.add_node()
            admin = plane.admin

            def post_real(claim: dict[str, Any], pod: dict[str, Any]) -> str:
                made = admin.request("POST", "/api/v1/namespaces/default/pods", body=pod)
                _reserve(claim, pod, made["metadata"]["uid"])
                status = claim.pop("status")
                claim["spec"]["devices"]["requests"] = [
                    {"name": "gpu", "exactly": {"deviceClassName": "gpushare.io"}}
                ]
                created = admin.request("POST", CLAIMS, body=claim)
                created["status"] = status  # as the scheduler writes it
                name = created["metadata"]["name"]
                stored = admin.request("PUT", f"{CLAIMS}/{name}/status", body=created)
                claim["metadata"]["uid"] = stored["metadata"]["uid"]
                return str(made["metadata"]["uid"])

            return _dra_rounds(plan, root, admin, post_real, rounds)
        finally:
            plane.stop()


def pod_name(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["name"])


def _reserve(claim: dict[str, Any], pod: dict[str, Any], uid: str) -> None:
    """Reserve ``claim`` for ``pod`` (UID ``uid``), as the scheduler does before binding."""
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": pod_name(pod), "uid": uid}]


def _dra_rounds(
    plan: Plan,
    root: Path,
    client: Any,
    create: Callable[[dict[str, Any], dict[str, Any]], str],
    rounds: int,
) -> tuple[str, str, str, str, bool]:
    """The DRA part serving ``plan.cards`` simulated H200 in this process, the stand-in
    kubelet calling over the plugin's unix socket from a process of its own (as the
    kubelet does: the caller's side of gRPC is not this process's work, and the two do
    not share one interpreter lock). Each round creates, not timed, a pod bound to the
    node whose container uses one claim, and that claim allocated and reserved for the
    pod (as the kubelet sees every claim it prepares), and waits until the part's pod
    watch (the daemon's, :class:`~gpushare.kube.podwatch.PodWatch`) holds the pod, as it
    normally does by the time the kubelet, which learns of the pod from its own watch,
    prepares its claims; then it prepares the claim (timed by the caller: the GET, the
    claim's mates from the pod, the checks, the answer, a cache directory, the CDI spec
    and the checkpoint entry), GETs the same claim with the part's client (timed: the
    baseline), makes the same call with no claim (timed by the caller: the gRPC floor,
    for context) and unprepares it. Returns the row's cells."""
    from gpushare.base.logs import configure_logging

    # The part logs as the DaemonSet's daemon does: JSON lines, info and up, here to a file.
    log_file = (root / "dra.log").open("w")
    configure_logging("json", "info", log_file)
    part = watch = None
    watched = 0  # rounds whose pod the watch held when prepared
    kubelet = DraCaller(root / "kubelet")
    times = _DraTimes()
    try:
        part, driver, watch = _dra_part(plan, root, client)
        watch.start()
        part.start()
        kubelet.register()
        for i in range(rounds):
            claim = _bench_claim(i, plan.cards, driver)
            uid = create(claim, _bench_pod(i))  # the pod's
            watched += _held_by_watch(watch, uid)
            times.round(kubelet, client, ("default", f"bench-{i}", claim["metadata"]["uid"]))
    finally:
        kubelet.close()
        if part is not None:
            part.stop()
        if watch is not None:
            watch.stop()
        log_file.close()
    setting = (
        f"{plan.cards} x H200, {rounds} claims reserved for pods, {watched} of them "
        f"held by the pod watch, {kubelet.kind})"
    )
    return _dra_row(setting, times.prepare, times.get, times.empty)


@dataclass
class _DraTimes:
    """What the DRA rounds measured, in seconds."""

    prepare: list[float] = field(default_factory=list)  # as the caller saw it
    get: list[float] = field(default_factory=list)  # one GET of the claim: the baseline
    empty: list[float] = field(default_factory=list)  # the same call with no claim

    def round(self, kubelet: DraCaller, client: Any, ref: tuple[str, str, str]) -> None:
        """Prepare claim ``ref`` (timed by the caller), GET it (timed here), make the
        empty call (the gRPC floor), and unprepare it."""
        seconds, error = kubelet.call("prepare", ref)
        if error:
            raise RuntimeError(f"prepare failed: {error}")
        self.prepare.append(seconds)
        began = time.perf_counter()
        client.get(f"{CLAIMS}/{ref[1]}")
        self.get.append(time.perf_counter() - began)
        self.empty.append(kubelet.call("empty")[0])  # the gRPC floor: no claim
        kubelet.call("unprepare", ref)


def _dra_row(
    setting: str, prepare: list[float], get: list[float], empty: list[float]
) -> tuple[str, str, str, str, bool]:
    """The DRA row's cells: the prepare's p50 and p99 against 2x one GET's p50."""
    p50, base = percentile(prepare, 50), percentile(get, 50)
    return (
        setting,
        f"p50 {ms(p50)}, p99 {ms(percentile(prepare, 99))}",
        "p50 <= 2x one GET of the claim",
        f"GET p50 {ms(base)}; {p50 / base:.1f}x (empty call {ms(percentile(empty, 50))})",
        p50 <= 2 * base,
    )


def _bench_claim(index: int, cards: int, driver: str) -> dict[str, Any]:
    """Claim ``bench-<index>``, allocated: 4 GiB and 30 cores of card ``index % cards``."""
    from gpushare.sim.drakubeletdouble import allocated_claim

    return allocated_claim(
        "default",
        f"bench-{index}",
        driver,
        NODE_NAME,
        [
            {
                "request": "gpu",
                "device": f"gpu-{index % cards}",
                "consumedCapacity": {"memory": "4Gi", "cores": "30"},
            }
        ],
    )


def _dra_part(plan: Plan, root: Path, client: Any) -> tuple[DraPart, str, PodWatch]:
    """The DRA part of the bench (not started), on ``plan.cards`` simulated H200 with a
    stand-in interposer and memory hook installed under ``root``; its driver name; and
    the daemon's pod watch it reads the reserving pods from (not started either)."""
    from gpushare.config import Settings
    from gpushare.dra.part import build_dra_part
    from gpushare.gpu.health import HealthBoard
    from gpushare.host.library import ensure_lock_dir, install_hook, install_library
    from gpushare.kube.podspecs import PodSpecBook
    from gpushare.kube.podwatch import PodWatch
    from gpushare.share.answers import DeviceListing, Enforcement

    gpus = node_gpus(plan.cards, H200_MIB)
    library = root / "libvgpu.so"
    library.write_bytes(stand_in(b"bench interposer\n"))
    host = root / "vgpu"
    hook = root / "gpushare-memory-hook"  # named by the claims' specs, never run here
    hook.write_bytes(stand_in(b"bench memory hook\n"))
    enforcement = Enforcement(
        install_library(library, host),
        None,
        True,
        ensure_lock_dir(host),
        limit_check=str(install_hook(hook, host)),
    )
    settings = Settings(host_lib_dir=str(host), dra_cdi_dir=str(root / "cdi"))
    watch = PodWatch(lambda: client, NODE_NAME, PodSpecBook(settings.resource_prefix))
    part = build_dra_part(
        settings,
        gpus,
        HealthBoard(g.uuid for g in gpus),
        enforcement,
        DeviceListing(),
        host,
        client,
        NODE_NAME,
        root / "kubelet",
        pcie_roots={},
        watched_pod=watch.claim_pod,
    )
    return part, settings.dra_driver, watch


def _bench_pod(index: int) -> dict[str, Any]:
    """Pod ``bench-<index>``, bound to the node, its container using claim ``bench-<index>``
    (as the kubelet sees every claim it prepares: reserved for a pod of its node)."""
    from gpushare.sim.drakubeletdouble import pod_using_claims

    pod = pod_using_claims("default", f"bench-{index}", NODE_NAME, {"main": [f"bench-{index}"]})
    pod["spec"]["containers"][0]["image"] = "registry.invalid/app"  # never pulled
    return pod


def _held_by_watch(watch: PodWatch, uid: str) -> bool:
    """Wait (not timed: the watch normally holds a pod by the time the kubelet, which
    learns of it from its own watch, prepares its claims) until ``watch`` holds pod
    ``uid``; False if it did not within 10 s (the prepare then GETs the pod)."""
    deadline = time.monotonic() + 10
    while watch.claim_pod(uid) is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return watch.claim_pod(uid) is not None


class DraCaller:
    """The kubelet's side of the DRA calls, timed as the kubelet sees them.

    Registration goes through the stand-in kubelet (:class:`DraKubelet`). The calls are
    made by ``dracall`` (built by ``make e2e`` beside the cluster's binaries: grpc-go and
    the kubelet's DRA v1 client, in a process of its own, as the kubelet makes them)
    where it is built, else by the stand-in in this process, whose own Python gRPC client
    and interpreter lock then count in the figure (:attr:`kind` says which)."""

    def __init__(self, kubelet_root: Path) -> None:
        from gpushare.sim import controlplane
        from gpushare.sim.drakubeletdouble import DraKubelet

        self.kubelet = DraKubelet(kubelet_root)
        self._program = controlplane.BIN / "dracall"
        self._process: subprocess.Popen[str] | None = None
        self.kind = "grpc-go caller" if self._program.is_file() else "Python caller"

    def register(self) -> None:
        self.kubelet.register()
        if self._program.is_file():
            self._process = subprocess.Popen(
                [str(self._program), f"--socket={self.kubelet.info.endpoint}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )

    def call(self, what: str, ref: tuple[str, str, str] | None = None) -> tuple[float, str]:
        """(seconds the call took, as the caller saw it; its error, "" if none)."""
        if self._process is None:
            return self._call_here(what, ref)
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(" ".join([what, *(ref or ())]) + "\n")
        self._process.stdin.flush()
        seconds, _, error = self._process.stdout.readline().rstrip("\n").partition(" ")
        if not seconds:
            raise RuntimeError(f"dracall ended (exit status {self._process.poll()})")
        if what != "prepare" and error:
            raise RuntimeError(f"DRA {what} failed: {error}")
        return float(seconds), error

    def _call_here(self, what: str, ref: tuple[str, str, str] | None) -> tuple[float, str]:
        began = time.perf_counter()
        if what == "empty":
            self.kubelet.prepare([])
            error = ""
        elif what == "prepare" and ref is not None:
            error = self.kubelet.prepare([ref])[ref[2]].error
        elif ref is not None:
            error = self.kubelet.unprepare([ref])[ref[2]]
            if error:
                raise RuntimeError(f"DRA {what} failed: {error}")
        return time.perf_counter() - began, error

    def close(self) -> None:
        if self._process is not None:
            end_on_stdin_close(self._process)
        self.kubelet.close()


# --------------------------------------------------------------------------- main


def measure_memory_hook(plan: Plan, report: Report) -> None:
    """The driver memory hook's cost to a container's creation (simulated NVML)."""
    from gpushare.sim import hookbench

    figure = "driver memory hook per container created, p50 / p99 (simulated NVML)"
    target = f"p50 <= {hookbench.TARGET_P50_SECONDS * 1000:.0f} ms"
    why_not = hookbench.available()
    if why_not:
        report.add(figure, f"not measured: {why_not}", target)
        return
    times = hookbench.measure(plan.latency_containers)
    p50 = percentile(times.seconds, 50)
    report.add(
        figure,
        f"{ms(p50)} / {ms(percentile(times.seconds, 99))} ({len(times.seconds)} containers"
        f"{f', {times.failures} FAILED' if times.failures else ''})",
        target,
        ok=p50 <= hookbench.TARGET_P50_SECONDS and not times.failures,
    )


def machine() -> str:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import grpc

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}, "
        f"grpcio {grpc.__version__}, {platform.system()} {platform.release()}; "
        f"load average before the run: {load}"
    )


#: The phases by the name ``--only`` takes, in the order a whole run makes them.
PHASES: dict[str, Callable[[Plan, Report], None]] = {
    "messages": measure_messages,
    "start": measure_start,
    "daemon": measure_daemon,
    "dra": measure_dra,
    "hook": measure_memory_hook,
}


def run(plan: Plan, phases: Sequence[Callable[[Plan, Report], None]] | None = None) -> Report:
    report = Report()
    for phase in phases or PHASES.values():
        phase(plan, report)
    return report


def build_parser() -> Parser:
    parser = Parser(prog="python -m gpushare.bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tiny run for the smoke test")
    parser.add_argument("--write", metavar="PATH", help="put the table into PATH's bench section")
    parser.add_argument("--out", metavar="PATH", help="write the report to PATH, a file of its own")
    parser.add_argument(
        "--latency-only",
        action="store_true",
        help="only the daemon's call latencies and the pairing rows (no start, idle, growth, "
        "DRA or hook rows: minutes, not ten); printed and --out only, never --write",
    )
    parser.add_argument(
        "--only",
        choices=sorted(PHASES),
        action="append",
        help="only these phases' rows (repeatable; dra: the DRA prepare rows, a minute): "
        "printed and --out only, never --write",
    )
    parser.add_argument(
        "--idle-seconds",
        type=bounded_float(0.1, 86400),
        help="length of the idle CPU measurement (default 60)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.latency_only or args.only) and args.write:
        parser.error("--latency-only and --only measure a few rows: they do not --write")
    if args.latency_only and args.only:
        parser.error("--latency-only and --only do not go together")
    plan = QUICK if args.quick else FULL
    if args.idle_seconds is not None:
        plan = Plan(**{**plan.__dict__, "idle_seconds": args.idle_seconds})
    about = machine()
    started = time.perf_counter()
    try:
        phases: list[Callable[[Plan, Report], None]]
        if args.latency_only:
            phases = [partial(measure_daemon, latency_only=True)]
        else:
            phases = [PHASES[name] for name in PHASES if name in (args.only or PHASES)]
        report = run(plan, phases)
    except Exception as exc:
        print(f"gpushare.bench: the benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    took = time.perf_counter() - started
    _publish(report, args, took, about)
    return 1 if report.missed else 0


def _publish(report: Report, args: argparse.Namespace, took: float, about: str) -> None:
    """Print the table and its summary; write it where ``--out`` and ``--write`` say."""
    table = report.table()
    print(table)
    for note in report.notes[:10]:
        print(f"note: {note}")
    missed = report.missed
    command = (
        "python -m gpushare.bench"
        + (" --quick" if args.quick else "")
        + (" --latency-only" if args.latency_only else "")
        + "".join(f" --only {name}" for name in args.only or ())
    )
    summary = (
        f"{len(missed)} target(s) missed: " + "; ".join(row.figure for row in missed)
        if missed
        else "every target met"
    )
    print(f"\n{summary} ({took:.0f} s; {about})")
    body = "\n".join(
        [
            f"Produced by `make bench` (`{command}`) on "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {took:.0f} s.",
            f"Machine: {about}.",
            "",
            table,
            "",
            f"Result: {summary}.",
        ]
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(body + "\n")
        print(f"wrote {args.out}")
    if args.write:
        replace_section(Path(args.write), "bench", body)
        print(f"rewrote the bench section of {args.write}")


if __name__ == "__main__":
    sys.exit(main())
