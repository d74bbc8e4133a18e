"""The benchmark's plan (full or quick) and its report: one table of figures, each beside
its target and the baseline measured in the same run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Plan:
    cards: int  # H200 cards on the simulated node
    runs: int  # repetitions of the start, latency and throughput measurements
    latency_containers: int  # admitted per latency run
    allocations: int  # Allocate calls for the growth check
    idle_seconds: float
    #: Wait before the idle measurement: the work the warm-up leaves (pod annotations
    #: retried until the kubelet's records show the pod) runs first.
    quiet_seconds: float
    window: int  # containers alive at once; the oldest is released beyond this
    serialize_reps: int


FULL = Plan(
    cards=8,
    runs=5,
    latency_containers=400,
    allocations=10_000,
    idle_seconds=60.0,
    quiet_seconds=15.0,
    window=40,
    serialize_reps=300,
)
QUICK = Plan(
    cards=2,
    runs=1,
    latency_containers=12,
    allocations=24,
    idle_seconds=0.5,
    quiet_seconds=0.1,
    window=6,
    serialize_reps=5,
)


@dataclass
class Row:
    figure: str
    measured: str
    target: str
    baseline: str = ""
    ok: bool | None = None  # None: information only


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *args: Any, **kwargs: Any) -> None:
        self.rows.append(Row(*args, **kwargs))

    @property
    def missed(self) -> list[Row]:
        return [row for row in self.rows if row.ok is False]

    def table(self) -> str:
        lines = [
            "| figure | measured | target | baseline (same run) | met |",
            "|---|---:|---|---|:---:|",
        ]
        for r in self.rows:
            met = "-" if r.ok is None else ("yes" if r.ok else "**NO**")
            lines.append(f"| {r.figure} | {r.measured} | {r.target} | {r.baseline} | {met} |")
        return "\n".join(lines)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"
