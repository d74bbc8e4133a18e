"""What one measurement recorded: each tenant's line (the worker's JSON) and the step
it belonged to. Plain data with a JSON round trip: the results file holds them, the
table is rebuilt from them (``python -m gpushare.bench.gpu --table results.json``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: The worker's stages, in order: seconds from the parent's spawn of the process.
STAGES = ("main", "gate", "init", "context", "module", "first_kernel")


@dataclass(frozen=True)
class TenantResult:
    """One tenant process. ``rate``: kernels completed per second in its counted window
    (0 where it did not run one). ``asked_mib`` / ``allocated_mib``: what it tried to hold
    before the window and what it got (``alloc_error``: the first refusal's name)."""

    rate: float = 0.0
    asked_mib: int = 0
    allocated_mib: int = 0
    alloc_error: str = ""
    stages: dict[str, float] = field(default_factory=dict)
    error: str = ""
    role: str = ""  # "a", "b"; in pressure runs "aggressor" and "victim"

    @property
    def allocations_held(self) -> bool:
        return self.allocated_mib >= self.asked_mib and not self.alloc_error

    @classmethod
    def parse(cls, line: str, role: str = "") -> TenantResult:
        """The worker's last output line; a line that is not its JSON is an error result
        carrying the line (so a crashed tenant is reported, not lost)."""
        try:
            raw = json.loads(line)
            if not isinstance(raw, dict):
                raise ValueError("not an object")
            return cls.from_json({**raw, "role": role or raw.get("role", "")})
        except (ValueError, TypeError) as exc:
            return cls(error=f"no result ({exc}): {line.strip()[-300:]}", role=role)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> TenantResult:
        stages = raw.get("stages") or {}
        return cls(
            rate=float(raw.get("rate", 0.0) or 0.0),
            asked_mib=int(raw.get("asked_mib", 0) or 0),
            allocated_mib=int(raw.get("allocated_mib", 0) or 0),
            alloc_error=str(raw.get("alloc_error", "") or ""),
            stages={str(k): float(v) for k, v in dict(stages).items()},
            error=str(raw.get("error", "") or ""),
            role=str(raw.get("role", "") or ""),
        )


@dataclass(frozen=True)
class Measurement:
    """One step's outcome. ``hook_seconds``: each memory-hook run of the step (driver
    backends), from exec to exit."""

    scenario: str
    backend: str
    run: int
    tenants: tuple[TenantResult, ...]
    hook_seconds: tuple[float, ...] = ()
    error: str = ""

    @property
    def rates(self) -> list[float]:
        return [t.rate for t in self.tenants]

    @property
    def ok(self) -> bool:
        return not self.error and all(not t.error for t in self.tenants)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Measurement:
        return cls(
            scenario=str(raw["scenario"]),
            backend=str(raw["backend"]),
            run=int(raw.get("run", 0)),
            tenants=tuple(TenantResult.from_json(t) for t in raw.get("tenants", ())),
            hook_seconds=tuple(float(s) for s in raw.get("hook_seconds", ())),
            error=str(raw.get("error", "") or ""),
        )
