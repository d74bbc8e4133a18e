"""Which backends this machine can measure, and the steps of the measurement: decided
from :class:`~gpushare.bench.gpu.facts.Facts` alone (pure; ``DRY=1`` prints it).

The backends are the combinations an operator can choose per card (docs/choosing.md):

* ``time-sliced``: plain concurrent processes, nothing limited (NVIDIA's time-sliced
  replicas); every machine with a card has it.
* ``interposer``: HAMi-core's ``libvgpu.so`` by ``LD_PRELOAD``, memory
  (``CUDA_DEVICE_MEMORY_LIMIT_0``) and compute (``CUDA_DEVICE_SM_LIMIT``): what gpushare
  hands a container with ``vcuda-memory`` and ``vcuda-core``.
* ``interposer-memory``: HAMi-core's memory limit alone, compute time-sliced (no SM
  limit): the "HAMi" setting of NVIDIA Dynamo's figures and of HAMi's own comparison
  with time-slicing.
* ``mps``: an MPS control daemon, compute by active-thread percentage and memory by the
  pinned limit (v3 namespaces where the driver has them, else each client's env).
* ``driver``: the driver's per-cgroup memory limit (r615+, set by gpushare's memory hook
  on a scratch cgroup per tenant), compute time-sliced.
* ``driver+mps``: the driver's memory limit and MPS's compute share: the "driver-native"
  rows of Dynamo's figures.

A backend the machine lacks is in the plan as absent, with the reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpushare.bench.gpu.facts import DRIVER_LIMITS_MAJOR, Card, Facts

BACKENDS = ("time-sliced", "interposer", "interposer-memory", "mps", "driver", "driver+mps")
#: Estimated seconds a tenant takes to start (interpreter, cuInit, context, module JIT).
SPAWN_S = 2.0
#: Estimated seconds a pressure run spends allocating (the aggressor, then the victim).
ALLOC_S = 3.0
#: Estimated seconds of one start measurement: one process, and a crowd of them.
START_ONE_S, START_CROWD_S = 3.0, 12.0
#: Estimated seconds an MPS control daemon takes to start and stop.
MPS_S = 2.0
#: What ``make gpu-bench`` must fit in with ``make gpu-proof`` beside it (600 s a call).
BUDGET_S = 450.0


@dataclass(frozen=True)
class Settings:
    runs: int = 3  # of each throughput measurement (dedicated, pair)
    alone_runs: int = 1  # one tenant alone at its share: informative, one run
    pressure_runs: int = 1
    seconds: float = 3.0  # each counted window
    warmup: float = 1.5  # launches before the window (clocks up, module loaded)
    #: HAMi-core starts a process with a full bucket of tokens (2-3 s unthrottled on an
    #: H200, docs/gpu-proof.md): its tenants warm up longer than that
    interposer_warmup: float = 4.0
    share: int = 50  # percent of the card's memory and compute per tenant
    crowd: int = 20  # processes started at once
    blocks: int = 4096
    threads: int = 256
    iters: int = 20000
    batch: int = 8  # launches between synchronisations: the queue never runs dry

    def warmup_for(self, backend: str) -> float:
        return self.interposer_warmup if backend == "interposer" else self.warmup


@dataclass(frozen=True)
class Backend:
    name: str
    memory: str  # what holds a tenant's memory share
    compute: str  # what holds its compute share
    present: bool
    reason: str  # why it is absent; where present, a note ("" for none)

    @property
    def mps(self) -> bool:
        return self.name in ("mps", "driver+mps")

    @property
    def driver(self) -> bool:
        return self.name in ("driver", "driver+mps")


@dataclass(frozen=True)
class Step:
    """One measurement: ``scenario`` is dedicated (one tenant, whole card, nothing
    limited), alone (one tenant at its share), pair (two tenants at their shares),
    pressure (one tenant past its limit at 100 %, the other within its share), start
    (``tenants`` processes started at once, time to the first kernel), python (the
    interpreter alone: the part of a start that is not CUDA's) or control (dedicated
    again, last: how far the card drifted)."""

    scenario: str
    backend: str
    run: int
    tenants: int
    seconds: float


@dataclass(frozen=True)
class Plan:
    card: Card | None
    share_mib: int
    backends: tuple[Backend, ...]
    steps: tuple[Step, ...]
    settings: Settings

    @property
    def present(self) -> tuple[Backend, ...]:
        return tuple(b for b in self.backends if b.present)

    @property
    def total_seconds(self) -> float:
        return sum(s.seconds for s in self.steps) + MPS_S * sum(b.mps for b in self.present)

    def to_json(self) -> dict[str, Any]:
        return {
            "card": asdict(self.card) if self.card else None,
            "share_mib": self.share_mib,
            "backends": [asdict(b) for b in self.backends],
            "steps": [asdict(s) for s in self.steps],
            "settings": asdict(self.settings),
            "total_seconds": self.total_seconds,
        }


def _driver_reason(facts: Facts) -> str:
    major = facts.driver_major
    if major is None or major < DRIVER_LIMITS_MAJOR:
        card = facts.card
        return f"driver {card.driver if card else '?'} is older than r{DRIVER_LIMITS_MAJOR}"
    if facts.cgroup_fs != "cgroup2fs":
        return f"no cgroup v2 at /sys/fs/cgroup ({facts.cgroup_fs or 'nothing'} there)"
    if not facts.limits_backend:
        return "the driver's memory accounting is off (RmMemacctMode=0)"
    if not facts.root:
        return "not root: cannot make cgroups or set limits"
    if not facts.hook and not facts.gcc:
        return "no memory hook program and no gcc to build it from hook/memory-hook.c"
    return ""


def _backends(facts: Facts) -> tuple[Backend, ...]:
    card = facts.card
    if card is None:
        why = f"no GPU ({facts.smi_error or 'nvidia-smi listed none'})"
        return tuple(Backend(n, "", "", False, why) for n in BACKENDS)
    if card.mig == "Enabled":
        why = "MIG mode is on (the bench never changes it): the card is divided in hardware"
        return tuple(Backend(n, "", "", False, why) for n in BACKENDS)
    interposer_why = ""
    if not facts.interposer:
        interposer_why = "no libvgpu.so (scripts/gpu-bench-prepare.sh builds it)"
    elif facts.interposer_check and "every required hook" not in facts.interposer_check:
        interposer_why = f"libvgpu.so refused: {facts.interposer_check}"
    mps_why = "" if facts.mps_control else "no nvidia-cuda-mps-control on PATH"
    mps_note = (
        "v3 namespaces" if facts.mps_namespaces else "legacy protocol: caps in each client's env"
    )
    mps_memory = (
        "MPS pinned limit (namespace)" if facts.mps_namespaces else "MPS pinned limit (env)"
    )
    driver_why = _driver_reason(facts)
    limits = f"driver ({facts.limits_backend})" if facts.limits_backend else "driver"
    both_why = "; ".join(w for w in (driver_why, mps_why) if w)
    return (
        Backend("time-sliced", "nothing", "time-slicing", True, ""),
        Backend("interposer", "HAMi-core", "HAMi-core SM limit", not interposer_why,
                interposer_why),
        Backend("interposer-memory", "HAMi-core", "time-slicing (no SM limit)",
                not interposer_why, interposer_why),
        Backend("mps", mps_memory, "MPS active threads", not mps_why, mps_why or mps_note),
        Backend("driver", limits, "time-slicing", not driver_why, driver_why),
        Backend("driver+mps", limits, "MPS active threads", not both_why,
                both_why or mps_note),
    )  # fmt: skip


def decide(facts: Facts, settings: Settings = Settings()) -> Plan:
    """The plan for this machine: every backend (present or why not) and each step."""
    backends = _backends(facts)
    card = facts.card
    share_mib = card.memory_mib * settings.share // 100 if card else 0
    steps: list[Step] = []
    if any(b.present for b in backends):
        dedicated = SPAWN_S + settings.warmup + settings.seconds
        steps += [Step("dedicated", "none", r, 1, dedicated) for r in range(settings.runs)]
        steps.append(Step("python", "none", 0, 1, 1.0))
        for backend in (b for b in backends if b.present):
            window = SPAWN_S + settings.warmup_for(backend.name) + settings.seconds
            steps += [Step("alone", backend.name, r, 1, window)
                      for r in range(settings.alone_runs)]  # fmt: skip
            steps += [Step("pair", backend.name, r, 2, window) for r in range(settings.runs)]
            steps += [Step("pressure", backend.name, r, 2, window + ALLOC_S)
                      for r in range(settings.pressure_runs)]  # fmt: skip
            steps.append(Step("start", backend.name, 0, 1, START_ONE_S))
            steps.append(Step("start", backend.name, 1, settings.crowd, START_CROWD_S))
        steps.append(Step("control", "none", 0, 1, dedicated))
    return Plan(card, share_mib, backends, tuple(steps), settings)


def render(plan: Plan, facts: Facts) -> str:
    """The plan as ``DRY=1`` prints it: the facts it was decided on, each backend, the
    steps per backend, the estimated time."""
    card = plan.card
    lines = [
        f"card: {card.name} ({card.uuid}), {card.memory_mib} MiB, driver {card.driver}, "
        f"MIG {card.mig}, persistence {card.persistence}, compute mode {card.compute_mode}"
        if card
        else f"card: none ({facts.smi_error})",
        f"kernel {facts.kernel}; /sys/fs/cgroup: {facts.cgroup_fs or 'nothing'}; "
        f"dmem.capacity: {facts.dmem_capacity or 'absent'}; RmMemacctMode: "
        f"{facts.memacct_mode or 'not set'}; driver memory limits: "
        f"{facts.limits_backend or 'none'}",
        f"mps control: {facts.mps_control or 'absent'}"
        + (f" (multi-user {facts.mps_multi_user}, v3 namespaces {facts.mps_namespaces})"
           if facts.mps_control else ""),
        f"interposer: {facts.interposer or 'absent'} {facts.interposer_check}".rstrip(),
        f"memory hook: {facts.hook or 'absent'} (gcc {'here' if facts.gcc else 'absent'}); "
        f"root: {facts.root}",
        f"each tenant's share: {plan.settings.share} % = {plan.share_mib} MiB and "
        f"{plan.settings.share} % of the compute",
    ]  # fmt: skip
    for backend in plan.backends:
        if backend.present:
            count = sum(1 for s in plan.steps if s.backend == backend.name)
            note = f" ({backend.reason})" if backend.reason else ""
            lines.append(f"backend {backend.name}: present{note}; memory {backend.memory}, "
                         f"compute {backend.compute}; {count} steps")  # fmt: skip
        else:
            lines.append(f"backend {backend.name}: absent: {backend.reason}")
    lines.append(f"steps: {len(plan.steps)}, about {plan.total_seconds:.0f} s")
    return "\n".join(lines)
