"""gpushare.bench.writes: the writes table names each mode as the docs do, one row per
run, and ends with the kubelet's own writes for reference. (The counting runs,
``run_mode``, change the link's intervals for their process: they run as children, in
make scale.)"""

from __future__ import annotations

from gpushare.bench.writes import KUBELET_LEASE_PER_MINUTE, table


def row(mode: str, rate: float) -> dict[str, object]:
    patch = 0 if mode == "object" else 812
    return {"mode": mode, "pods_per_minute": rate, "node_per_minute": 0.5,
            "object_per_minute": 1.25, "node_patch_bytes": patch}  # fmt: skip


def test_one_row_per_run_and_the_kubelet_for_reference() -> None:
    lines = table([row("annotation", 1), row("both", 1), row("object", 1)])
    assert lines[0].startswith("| daemon | pods/min/node |") and lines[1].startswith("|---")
    assert lines[2] == "| `--node-state annotation` | 1 | 0.50 | 1.25 | 812 |"
    assert lines[3].startswith("| `--node-state both` (default, rollout) |")
    assert lines[4].endswith("| 1.25 | - |")  # no Node PATCH in mode object
    assert lines[5].startswith("| kubelet (reference, defaults) |")
    assert f"| {KUBELET_LEASE_PER_MINUTE:g} (its Lease) |" in lines[5]
