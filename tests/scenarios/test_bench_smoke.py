"""The benchmark runs end to end in its quick mode and prints every row (no timing
is asserted: CI times nothing); its --write keeps the rest of the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpushare.ops.mdsection import replace_section
from gpushare.sim import controlplane

ROWS = [
    "ListAndWatch message serialised",
    "largest message, 16 x 192 GiB",
    "start: process start to both resources registered",
    "idle RSS after start (API link, pod watch and metrics on)",
    "baseline: empty unary call",
    "Allocate vcuda-memory",
    "Allocate vcuda-core",
    "GetPreferredAllocation vcuda-memory",
    "GetPreferredAllocation vcuda-core",
    "whole admission (two resources, four calls)",
    "RSS after",
    "open descriptors after",
    "containers whose memory and core landed on two cards",
    "admissions refused",
    "pods created and deleted on the API server during the run",
    "idle wake-ups over",
    "idle CPU over",
    "DRA NodePrepareResources, one share, API-server double",
]
#: Measured only where make e2e has built the control plane's binaries.
REAL_API_ROW = "DRA NodePrepareResources, one share, real kube-apiserver"
#: The last row: what the driver memory hook adds to a container's creation.
HOOK_ROW = "driver memory hook per container created"


def test_quick_bench_prints_one_table_with_every_row(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nHand-written notes.\n")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "gpushare.bench", "--quick", "--write", str(doc)),
            *("--out", str(tmp_path / "out" / "bench.md")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 1), result.stderr  # 1: a target missed, 2: it broke
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| figure | measured | target |")
    body = table[1:]
    rows = ROWS + ([REAL_API_ROW] if controlplane.available() else []) + [HOOK_ROW]
    assert len(body) == len(rows)
    for row, name in zip(body, rows, strict=True):
        assert name in row, (name, row)
        assert row.rstrip().endswith(("| yes |", "| **NO** |", "| - |")), row
    assert "| containers whose memory and core landed on two cards | 0 |" in result.stdout
    written = doc.read_text()
    assert written.startswith("# Benchmarks\n\nHand-written notes.\n")
    assert "<!-- bench:start -->" in written and "<!-- bench:end -->" in written
    assert all(name in written for name in rows)
    own = (tmp_path / "out" / "bench.md").read_text()  # make bench: bench-out/, not the doc
    assert own.startswith("Produced by `make bench`") and all(name in own for name in rows)


#: What --latency-only measures: the call latencies and the pairing rows, nothing else.
LATENCY_ROWS = ROWS[4:10] + ROWS[12:15]


def test_latency_only_prints_the_call_and_pairing_rows_and_never_writes_the_doc(
    tmp_path: Path,
) -> None:
    out = tmp_path / "latency.md"
    command = [sys.executable, "-m", "gpushare.bench", "--quick", "--latency-only"]
    result = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode in (0, 1), result.stderr
    body = [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    assert len(body) == len(LATENCY_ROWS)
    for row, name in zip(body, LATENCY_ROWS, strict=True):
        assert name in row, (name, row)
    assert "| containers whose memory and core landed on two cards | 0 |" in result.stdout
    assert "`python -m gpushare.bench --quick --latency-only`" in out.read_text()
    refused = subprocess.run(
        [*command, "--write", str(tmp_path / "doc.md")], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "--latency-only" in refused.stderr
    assert not (tmp_path / "doc.md").exists()


def test_only_a_phase_prints_its_rows_and_never_writes_the_doc(tmp_path: Path) -> None:
    out = tmp_path / "messages.md"
    command = [sys.executable, "-m", "gpushare.bench", "--quick", "--only", "messages"]
    result = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode in (0, 1), result.stderr
    body = [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    assert len(body) == 2 and ROWS[0] in body[0] and ROWS[1] in body[1], body
    assert "`python -m gpushare.bench --quick --only messages`" in out.read_text()
    refused = subprocess.run(
        [*command, "--write", str(tmp_path / "doc.md")], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "--only" in refused.stderr
    assert not (tmp_path / "doc.md").exists()


def test_make_bench_and_simulate_leave_the_tracked_doc_alone_unless_asked() -> None:
    """Issue 33.8: they rewrote docs/benchmarks.md on every run; now only UPDATE_DOCS=1."""
    root = Path(__file__).resolve().parents[2]

    def planned(*args: str) -> str:
        done = subprocess.run(["make", "-n", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    for target in ("bench", "simulate"):
        assert "docs/benchmarks.md" not in planned(target)
        assert f"bench-out/{target}.md" in planned(target)
        assert "docs/benchmarks.md" in planned(target, "UPDATE_DOCS=1")


def test_a_section_is_replaced_in_place(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("before\n")
    replace_section(doc, "s", "first")
    replace_section(doc, "s", "second")
    replace_section(doc, "t", "other")
    assert doc.read_text() == (
        "before\n\n<!-- s:start -->\nsecond\n<!-- s:end -->\n"
        "\n<!-- t:start -->\nother\n<!-- t:end -->\n"
    )
