"""Trace-driven placement simulation: what the scheduler extender buys on multi-card nodes.

A cluster of nodes with 1, 2, 4 and 8 cards receives pods that arrive and leave (a
seeded, deterministic trace with a mix of sizes seen in shared-GPU clusters: many
small inference pods, fewer large ones, some with core limits, some with a GPU
sidecar). Each pod is scheduled twice over, on two copies of the cluster:

* **without the extender** the scheduler knows only each node's totals of
  ``vcuda-memory`` and ``vcuda-core`` (NodeResourcesFit), scores nodes on those
  totals, and the daemon then looks for one card per container. When no card holds a
  container the kubelet fails the pod with ``UnexpectedAdmissionError``: an
  **admission failure**;
* **with the extender** only nodes where :func:`gpushare.extender.fit.fit_pod` finds
  a card for every container are candidates, scored by the extender's score.

The node is the real one: each simulated node runs the gpushare daemon on simulated
cards, and a pod sent there is admitted by the kubelet stand-in over gRPC (containers
in order, resources in Go-map order, GetPreferredAllocation then Allocate). The
daemon's binder decides the cards, so an admission failure counted here is one that
can really happen. The scheduler side reads each node's free units from the kubelet's
allocations, as the extender reads the daemon's annotation.

A pod that no node can take is counted **unschedulable** (a real cluster keeps it
Pending). The daemons run with the same policy (binpack or spread) as the
scheduler's node scoring.

``python -m gpushare.sim.trace [--pods N] [--seed S] [--list-delay SECONDS] [--write PATH]``
prints a markdown report and exits 1 if any pod failed admission with the extender.
``--list-delay`` makes every node's kubelet answer PodResources ``List`` that late (a
busy node): the daemon waits for its records (``binding.RECORDS_WAIT``), so the
extender's runs must still see no admission failure.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gpushare.base.cli import Parser
from gpushare.base.logs import configure_logging
from gpushare.extender.fit import (
    BINPACK,
    PLACEMENTS,
    CardRoom,
    ContainerNeed,
    PodNeed,
    fit_pod,
    score,
)
from gpushare.ops.mdsection import replace_section
from gpushare.sim.daemonnode import DaemonNode

UNIT_MIB = 256

#: Admission failure reasons listed per run in the report (the rest are counted).
REASONS_SHOWN = 3

#: (cards per node, card model, MiB per card, nodes of this shape)
NODE_SHAPES: tuple[tuple[int, str, int, int], ...] = (
    (1, "Tesla T4", 15360, 3),
    (2, "NVIDIA A10", 23028, 3),
    (4, "Tesla V100-SXM2-32GB", 32768, 3),
    (8, "NVIDIA A100-SXM4-40GB", 40960, 3),
)

#: Memory sizes in GiB and their weights: mostly small inference pods.
MEMORY_MIX: tuple[tuple[float, int], ...] = (
    (1, 20),
    (2, 20),
    (4, 22),
    (6, 10),
    (8, 12),
    (12, 8),
    (16, 5),
    (20, 3),
)
CORE_MIX: tuple[tuple[int, int], ...] = ((0, 55), (10, 10), (20, 12), (30, 10), (50, 10), (100, 3))


@dataclass(frozen=True)
class TracePod:
    number: int
    arrival: float
    duration: float
    need: PodNeed


def _weighted(rng: random.Random, mix: Sequence[tuple[float, int]]) -> float:
    return rng.choices([value for value, _ in mix], weights=[w for _, w in mix])[0]


def make_trace(pods: int, seed: int, load: float) -> list[TracePod]:
    """Poisson arrivals, log-normal lifetimes; ``load`` is offered memory / cluster memory."""
    rng = random.Random(seed)
    needs = []
    for _ in range(pods):
        memory = max(1, round(_weighted(rng, MEMORY_MIX) * 1024 / UNIT_MIB))
        core = int(_weighted(rng, CORE_MIX))
        draw = rng.random()
        containers: tuple[ContainerNeed, ...]
        if draw < 0.04:  # compute-heavy: the fewest memory units a container with cores
            # may ask (one asking none is refused by the policy and the daemon, issue 23)
            containers = (ContainerNeed("main", 1, max(core, 20)),)
        elif draw < 0.14:  # a GPU sidecar next to the main container
            sidecar = ContainerNeed("sidecar", rng.choice((2, 4, 8)), 0)
            containers = (ContainerNeed("main", memory, core), sidecar)
        else:
            containers = (ContainerNeed("main", memory, core),)
        needs.append(PodNeed(containers))
    capacity = sum(count * nodes * (mib // UNIT_MIB) for count, _, mib, nodes in NODE_SHAPES)
    mean_memory = statistics.fmean(need.memory_units for need in needs)
    mean_duration = 60.0
    rate = load * capacity / (mean_memory * mean_duration)
    sigma = 1.0
    mu = math.log(mean_duration) - sigma * sigma / 2
    trace, now = [], 0.0
    for number, need in enumerate(needs):
        now += rng.expovariate(rate)
        trace.append(TracePod(number, now, rng.lognormvariate(mu, sigma), need))
    return trace


@dataclass
class SimNode:
    name: str
    cards: int
    rooms: list[CardRoom]
    used_area: list[float] = field(default_factory=list)  # memory unit-seconds per card
    core_area: list[float] = field(default_factory=list)

    @property
    def memory_free(self) -> int:
        return sum(r.memory_free for r in self.rooms if r.healthy)

    @property
    def core_free(self) -> int:
        return sum(r.core_free for r in self.rooms if r.healthy)

    @property
    def memory_total(self) -> int:
        return sum(r.memory_units for r in self.rooms)


def _uuid(count: int, node: int, card: int) -> str:
    return f"GPU-{count:04x}{node:04x}-{card:04x}-4000-8000-000000000000"


def make_cluster() -> list[SimNode]:
    nodes = []
    for count, _model, mib, how_many in NODE_SHAPES:
        for n in range(how_many):
            rooms = [
                CardRoom(_uuid(count, n, i), i, mib // UNIT_MIB, mib // UNIT_MIB, 100)
                for i in range(count)
            ]
            nodes.append(SimNode(f"{count}card-{n}", count, rooms, [0.0] * count, [0.0] * count))
    return nodes


def start_daemons(
    nodes: Sequence[SimNode], placement: str, list_delay: float = 0.0
) -> list[DaemonNode]:
    """The real daemon behind a kubelet stand-in, for each node; each kubelet answers
    PodResources ``List`` after ``list_delay`` seconds."""
    models = {count: (model, mib) for count, model, mib, _ in NODE_SHAPES}
    rigs: list[DaemonNode] = []
    try:
        for number, node in enumerate(nodes):
            model, mib = models[node.cards]
            cards = [(room.uuid, model, mib) for room in node.rooms]
            rig = DaemonNode(node.name, cards, placement, seed=number)
            rigs.append(rig)
            rig.start()
            rig.kubelet.list_delay = list_delay
    except BaseException:
        for rig in rigs:
            rig.stop()
        raise
    return rigs


@dataclass
class RunResult:
    placement: str
    extender: bool
    pods: int = 0
    admitted: int = 0
    unschedulable: int = 0
    admission_failures: int = 0
    card_memory_use: list[float] = field(default_factory=list)  # time-averaged, per card
    card_core_use: list[float] = field(default_factory=list)
    use_by_shape: dict[int, float] = field(default_factory=dict)
    failure_reasons: list[str] = field(default_factory=list)


def _totals_score(node: SimNode, pod: PodNeed, placement: str) -> float:
    """NodeResourcesFit on totals: MostAllocated for binpack, LeastAllocated for spread."""
    free_after = (node.memory_free - pod.memory_units) / node.memory_total
    return -free_after if placement == BINPACK else free_after


def simulate(
    trace: Sequence[TracePod], placement: str, extender: bool, list_delay: float = 0.0
) -> RunResult:
    nodes = make_cluster()
    rigs = start_daemons(nodes, placement, list_delay)
    try:
        result = _simulate(trace, placement, extender, nodes, rigs)
        result.failure_reasons = [reason for rig in rigs for reason in rig.failures]
        return result
    finally:
        for rig in rigs:
            rig.stop()


def _simulate(
    trace: Sequence[TracePod],
    placement: str,
    extender: bool,
    nodes: list[SimNode],
    rigs: list[DaemonNode],
) -> RunResult:
    result = RunResult(placement, extender, pods=len(trace))
    departures: list[tuple[float, int, int]] = []
    measure_from = trace[len(trace) // 10].arrival if trace else 0.0
    last = measure_from

    def account(until: float) -> None:
        nonlocal last
        if until <= last:
            return
        span = until - last
        for node in nodes:
            for i, room in enumerate(node.rooms):
                node.used_area[i] += (room.memory_units - room.memory_free) * span
                node.core_area[i] += (room.core_units - room.core_free) * span
        last = until

    for pod in trace:
        while departures and departures[0][0] <= pod.arrival:
            at, number, node_number = heapq.heappop(departures)
            account(at)
            rigs[node_number].release(f"pod-{number}")
            nodes[node_number].rooms = rigs[node_number].rooms()
        account(pod.arrival)
        need = pod.need
        chosen = _schedule(nodes, need, placement, extender)
        if chosen is None:
            result.unschedulable += 1
            continue
        use = rigs[chosen].admit(f"pod-{pod.number}", need)  # the daemon, card by card
        if use is None:
            result.admission_failures += 1
            continue
        nodes[chosen].rooms = rigs[chosen].rooms()
        result.admitted += 1
        heapq.heappush(departures, (pod.arrival + pod.duration, pod.number, chosen))
    end = trace[-1].arrival if trace else 0.0
    account(end)
    _card_use(result, nodes, max(end - measure_from, 1e-9))
    return result


def _schedule(
    nodes: list[SimNode], need: PodNeed, placement: str, extender: bool
) -> int | None:
    """The node the scheduler binds a pod of ``need`` to (None: unschedulable): among
    the nodes whose totals hold it, with the extender the best fit its cards allow,
    without it the best by the totals alone (ties: the lowest number)."""
    candidates = [
        (number, node)
        for number, node in enumerate(nodes)
        if node.memory_free >= need.memory_units and node.core_free >= need.core_units
    ]
    if extender:
        fits = [(n, node, fit_pod(node.rooms, need, placement)) for n, node in candidates]
        ranked = [
            ((score(fit, placement), _totals_score(node, need, placement), -n), n)
            for n, node, fit in fits
            if fit.fits
        ]
    else:
        ranked = [((0, _totals_score(node, need, placement), -n), n) for n, node in candidates]
    return max(ranked)[1] if ranked else None


def _card_use(result: RunResult, nodes: list[SimNode], span: float) -> None:
    """Each card's mean memory and core use over the measured ``span``, and the mean
    memory use by node shape (its number of cards)."""
    by_shape: dict[int, list[float]] = {}
    for node in nodes:
        for i, room in enumerate(node.rooms):
            memory = node.used_area[i] / span / room.memory_units
            result.card_memory_use.append(memory)
            result.card_core_use.append(node.core_area[i] / span / room.core_units)
            by_shape.setdefault(node.cards, []).append(memory)
    result.use_by_shape = {k: statistics.fmean(v) for k, v in sorted(by_shape.items())}


def _pct(value: float) -> str:
    return f"{100 * value:.1f} %"


def _quantiles(values: Sequence[float]) -> str:
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return f"{100 * cuts[0]:.0f} / {100 * statistics.median(values):.0f} / {100 * cuts[-1]:.0f} %"


def render_report(
    results: Sequence[RunResult], pods: int, seed: int, load: float, list_delay: float = 0.0
) -> str:
    shapes = ", ".join(f"{n} x {c}-card {model}" for c, model, _, n in NODE_SHAPES)
    cards = sum(c * n for c, _, _, n in NODE_SHAPES)
    slow = f"; every PodResources List answered after {list_delay:g} s" if list_delay else ""
    lines = [
        f"Trace: {pods} pods, seed {seed}, offered memory load {load:.2f} of the cluster; "
        f"{cards} cards on {shapes}{slow}. Utilisation is time-averaged per card after a "
        "10 % warm-up; p10 / p50 / p90 are across cards.",
        "",
        "| placement | extender | admitted | unschedulable | admission failures "
        "| card memory use (mean) | card memory use p10 / p50 / p90 | card core use (mean) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.placement} | {'yes' if r.extender else 'no'} "
            f"| {r.admitted} ({_pct(r.admitted / max(r.pods, 1))}) "
            f"| {r.unschedulable} | {r.admission_failures} "
            f"| {_pct(statistics.fmean(r.card_memory_use))} "
            f"| {_quantiles(r.card_memory_use)} "
            f"| {_pct(statistics.fmean(r.card_core_use))} |"
        )
    lines += [
        "",
        "Mean card memory use by node size:",
        "",
        "| placement | extender | " + " | ".join(f"{c}-card nodes" for c, *_ in NODE_SHAPES) + " |",
        "|---|---|" + "---:|" * len(NODE_SHAPES),
    ]
    for r in results:
        cells = " | ".join(_pct(r.use_by_shape[c]) for c, *_ in NODE_SHAPES)
        lines.append(f"| {r.placement} | {'yes' if r.extender else 'no'} | {cells} |")
    failed = [r for r in results if r.extender and r.failure_reasons]
    if failed:
        lines += ["", "Admission failures with the extender (the daemon refused the pod):", ""]
        for r in failed:
            shown = r.failure_reasons[:REASONS_SHOWN]
            lines += [f"- {r.placement}: {reason}" for reason in shown]
            if len(r.failure_reasons) > len(shown):
                lines.append(f"- {r.placement}: ... and {len(r.failure_reasons) - len(shown)} more")
    return "\n".join(lines) + "\n"


def run(
    pods: int, seed: int, load: float, list_delay: float = 0.0
) -> tuple[list[RunResult], str]:
    trace = make_trace(pods, seed, load)
    results = [
        simulate(trace, placement, extender, list_delay)
        for placement in PLACEMENTS
        for extender in (False, True)
    ]
    return results, render_report(results, pods, seed, load, list_delay)


def build_parser() -> Parser:
    parser = Parser(
        prog="python -m gpushare.sim.trace",
        description="Trace-driven placement simulation, with and without the scheduler extender.",
    )
    parser.add_argument("--pods", type=int, default=2000, help="pods in the trace")
    parser.add_argument("--seed", type=int, default=7, help="seed of the trace")
    parser.add_argument(
        "--load", type=float, default=1.0, help="offered memory load (1.0 = the cluster's memory)"
    )
    parser.add_argument(
        "--list-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="every kubelet answers PodResources List this late (a busy node; default 0)",
    )
    parser.add_argument("--write", metavar="PATH", help="also write the markdown report here")
    parser.add_argument(
        "--section",
        metavar="PATH",
        help="also put the report, with the command, into PATH's 'simulate' section "
        "(e.g. docs/benchmarks.md)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.pods < 20 or args.load <= 0 or not 0 <= args.list_delay <= 60:
        parser.error(
            "--pods must be at least 20, --load greater than 0, --list-delay 0 to 60 seconds"
        )
    saved = structlog.get_config()
    configure_logging("console", "error")  # the daemons' own events would drown the report
    started = time.perf_counter()
    try:
        results, report = run(args.pods, args.seed, args.load, args.list_delay)
    finally:
        structlog.configure(**saved)
    print(report, end="")
    print(f"\n({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        with open(args.write, "w") as out:
            out.write(report)
        print(f"wrote {args.write}", file=sys.stderr)
    if args.section:
        _write_section(Path(args.section), report, args)
    failures = sum(r.admission_failures for r in results if r.extender)
    if failures:
        print(f"FAILED: {failures} admission failures with the extender", file=sys.stderr)
        return 1
    return 0


def _write_section(path: Path, report: str, args: argparse.Namespace) -> None:
    """The report, with the command that made it, as ``path``'s 'simulate' section."""
    command = f"python -m gpushare.sim.trace --pods {args.pods} --seed {args.seed}"
    report += (
        "\nEvery pod is admitted by the real daemon (its binder behind the kubelet "
        "stand-in), so admission failures are ones that can really happen.\n"
    )
    if args.load != 1.0:
        command += f" --load {args.load}"
    if args.list_delay:
        command += f" --list-delay {args.list_delay:g}"
    body = f"Produced by `make simulate` (`{command}`).\n\n{report}"
    replace_section(path, "simulate", body)
    print(f"rewrote the simulate section of {path}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
