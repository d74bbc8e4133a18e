"""The report (markdown): throughput kept, isolation under pressure and start costs per
backend, beside the published figures users compare on (pure: records in, text out)."""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.bench.gpu.plan import Backend
from gpushare.bench.gpu.records import Measurement, TenantResult
from gpushare.bench.gpu.stats import Summary, percentile, share_of, summarize

#: (source, setting, throughput per GPU as a share of a dedicated GPU), as published.
PUBLISHED = (
    ("NVIDIA Dynamo many-model benchmark (8x A100 40GB, Qwen3-4B, two models per GPU, "
     "2/4/8/16/32 requests per GPU)", "driver-native: MPS v3 50 % SMs + dmem memory cap",
     "63.5 / 60.4 / 68.0 / 77.8 / 87.9 %"),
    ("the same", "HAMi: HAMi-core memory cap, time-sliced compute",
     "44.5 / 45.0 / 51.2 / 61.6 / 72.8 %"),
    ("Project-HAMi/gpu-sharing-benchmarks (A100, 2026-11)", "HAMi-core against plain "
     "time-slicing", "within 1-2 %"),
)  # fmt: skip


def pct(summary: Summary) -> str:
    """``71.2 %`` for one run, ``71.2 % (70.1-72.0)`` for several; ``-`` for none."""
    if summary.n == 0:
        return "-"
    if summary.n == 1:
        return percent(summary.median)
    return f"{percent(summary.median)} ({summary.low * 100:.1f}-{summary.high * 100:.1f})"


def percent(share: float) -> str:
    return f"{share * 100:.1f} %"


def seconds(values: Sequence[float]) -> str:
    return f"{percentile(values, 50):.2f} s" if values else "-"


def slowest(values: Sequence[float]) -> str:
    return f"{max(values):.2f} s" if values else "-"


def _of(measurements: Sequence[Measurement], scenario: str, backend: str) -> list[Measurement]:
    return [m for m in measurements if m.scenario == scenario and m.backend == backend and m.ok]


def dedicated_rate(measurements: Sequence[Measurement]) -> Summary:
    return summarize([m.rates[0] for m in _of(measurements, "dedicated", "none")])


def _throughput(backends: Sequence[Backend], measurements: Sequence[Measurement],
                share: int) -> list[str]:  # fmt: skip
    dedicated = dedicated_rate(measurements)
    lines = [
        "### Throughput kept",
        "",
        f"Two tenants, each at {share} % of the memory and {share} % of the compute, the same "
        "steady kernel in each; kernels per second as a share of one tenant alone on the "
        f"whole card (dedicated: {dedicated.median:.1f} kernels/s, {dedicated.n} runs, "
        f"spread {percent(dedicated.spread)}). Median of the runs, (lowest-highest).",
        "",
        "| backend | memory held by | compute held by | one tenant alone at its share | "
        "tenant A | tenant B | both together | runs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    aggregates: dict[str, float] = {}
    for backend in backends:
        if not backend.present:
            lines.append(f"| {backend.name} | | | absent: {backend.reason} | | | | 0 |")
            continue
        alone = share_of([m.rates[0] for m in _of(measurements, "alone", backend.name)],
                         dedicated.median)  # fmt: skip
        pairs = [m for m in _of(measurements, "pair", backend.name) if len(m.rates) == 2]
        a = share_of([m.rates[0] for m in pairs], dedicated.median)
        b = share_of([m.rates[1] for m in pairs], dedicated.median)
        both = share_of([sum(m.rates) for m in pairs], dedicated.median)
        if both.n:
            aggregates[backend.name] = both.median
        lines.append(f"| {backend.name} | {backend.memory} | {backend.compute} | {pct(alone)} | "
                     f"{pct(a)} | {pct(b)} | {pct(both)} | {len(pairs)} |")  # fmt: skip
    control = [m.rates[0] for m in _of(measurements, "control", "none")]
    if control and dedicated.median:
        drift = control[0] / dedicated.median
        lines += ["", f"Control run at the end, dedicated again: {percent(drift)} of the first "
                  "(the card's drift)."]  # fmt: skip
    if aggregates.get("time-sliced"):
        for name, what in (("interposer-memory", "HAMi-core's memory limit alone"),
                           ("interposer", "HAMi-core with its SM limit")):  # fmt: skip
            if name in aggregates:
                lines += ["", f"{what} against plain time-slicing, both tenants together: "
                          f"{percent(aggregates[name] / aggregates['time-sliced'])}."]  # fmt: skip
    lines += [
        "",
        "Published, for comparison (an LLM's request throughput there, a synthetic "
        "compute-bound kernel here: compare the shape, not the digits; `driver+mps` is the "
        "driver-native setting, `interposer-memory` is HAMi's):",
        "",
        "| source | setting | throughput per GPU, share of a dedicated GPU |",
        "| --- | --- | --- |",
        *(f"| {source} | {setting} | {figure} |" for source, setting, figure in PUBLISHED),
    ]
    return lines


def _pressure(backends: Sequence[Backend], measurements: Sequence[Measurement],
              share: int, share_mib: int) -> list[str]:  # fmt: skip
    dedicated = dedicated_rate(measurements)
    lines = [
        "### Isolation under pressure",
        "",
        f"The aggressor asks for {3 * share_mib // 2} MiB (1.5 x its {share_mib} MiB share) "
        "and then spins at 100 %; the victim then allocates 80 % of its share in steps, "
        "each of which must succeed, and runs the steady kernel.",
        "",
        "| backend | aggressor got (MiB) | aggressor stopped by | victim got / asked (MiB) | "
        "victim's allocations | victim's throughput, of a pair run | of dedicated |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for backend in backends:
        if not backend.present:
            continue
        runs = _of(measurements, "pressure", backend.name)
        if not runs:
            lines.append(f"| {backend.name} | no run completed | | | | | |")
            continue
        pair = summarize([r for m in _of(measurements, "pair", backend.name) for r in m.rates])
        for m in runs:
            aggressor, victim = _role(m, "aggressor"), _role(m, "victim")
            held = "all held" if victim.allocations_held else f"REFUSED ({victim.alloc_error})"
            of_pair = victim.rate / pair.median if pair.median else 0.0
            of_dedicated = victim.rate / dedicated.median if dedicated.median else 0.0
            lines.append(
                f"| {backend.name} | {aggressor.allocated_mib} | "
                f"{aggressor.alloc_error or 'nothing'} | {victim.allocated_mib} / "
                f"{victim.asked_mib} | {held} | {percent(of_pair)} | {percent(of_dedicated)} |"
            )
    return lines


def _role(m: Measurement, role: str) -> TenantResult:
    return next((t for t in m.tenants if t.role == role), TenantResult(role=role))


def _start(backends: Sequence[Backend], measurements: Sequence[Measurement],
           crowd: int) -> list[str]:  # fmt: skip
    python = [t.stages.get("main", 0.0) for m in _of(measurements, "python", "none")
              for t in m.tenants]  # fmt: skip
    lines = [
        "### What a start costs",
        "",
        "From the spawn of the process to its first kernel's completion (the median of "
        f"the processes; with {crowd} started at once also the slowest), and the part of it "
        "spent in `cuInit` and the context; the memory hook's own run (driver backends) "
        f"from exec to exit. The interpreter alone takes {seconds(python)} to reach main.",
        "",
        "| backend | 1 process: to first kernel | of which cuInit + context | "
        f"{crowd} at once: median | slowest | failed | memory hook: alone | "
        f"{crowd} at once (median, slowest) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for backend in backends:
        if not backend.present:
            continue
        runs = {m.run: m for m in measurements if m.scenario == "start"
                and m.backend == backend.name}  # fmt: skip
        one, many = runs.get(0), runs.get(1)
        first = [t.stages["first_kernel"] for t in one.tenants
                 if "first_kernel" in t.stages] if one else []  # fmt: skip
        cuda = [_cuda_init(t) for t in one.tenants if "context" in t.stages] if one else []
        crowd_first = [t.stages["first_kernel"] for t in many.tenants
                       if "first_kernel" in t.stages] if many else []  # fmt: skip
        failed = sum(1 for t in many.tenants if t.error) if many else 0
        hook_one = list(one.hook_seconds) if one else []
        hook_many = list(many.hook_seconds) if many else []
        row = [backend.name, seconds(first), seconds(cuda), seconds(crowd_first),
               slowest(crowd_first), str(failed), seconds(hook_one),
               f"{seconds(hook_many)}, {slowest(hook_many)}" if hook_many else "-"]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _cuda_init(tenant: TenantResult) -> float:
    began = tenant.stages.get("gate", tenant.stages.get("main", 0.0))
    return tenant.stages["context"] - began


def _failures(measurements: Sequence[Measurement]) -> list[str]:
    lines = []
    for m in measurements:
        problems = [m.error] if m.error else []
        problems += [f"{t.role or 'tenant'}: {t.error}" for t in m.tenants if t.error]
        if problems:
            lines.append(f"- {m.scenario} {m.backend} run {m.run}: {'; '.join(problems)}")
    return ["### What failed", "", *lines] if lines else []


def build(
    header: Sequence[str],
    backends: Sequence[Backend],
    measurements: Sequence[Measurement],
    *,
    share: int,
    share_mib: int,
    crowd: int,
) -> str:
    """The whole report: ``header`` lines (the card, the driver, the date), then one
    section per question, then whatever failed."""
    sections = [
        list(header),
        _throughput(backends, measurements, share),
        _pressure(backends, measurements, share, share_mib),
        _start(backends, measurements, crowd),
        _failures(measurements),
    ]
    return "\n\n".join("\n".join(s) for s in sections if s) + "\n"
