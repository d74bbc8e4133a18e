"""make gpu-bench's report without a GPU: the statistics, the tenants' records (and a
tenant that printed no result), and the markdown built from measurements."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from gpushare.bench.gpu import table
from gpushare.bench.gpu.plan import Backend
from gpushare.bench.gpu.records import Measurement, TenantResult
from gpushare.bench.gpu.stats import EMPTY, percentile, share_of, summarize

finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)

# -- statistics ---------------------------------------------------------------------------


def test_percentiles_and_summaries_of_known_values() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([], 50) == 0.0
    s = summarize([10.0, 12.0, 11.0])
    assert (s.n, s.median, s.low, s.high, s.mean) == (3, 11.0, 10.0, 12.0, 11.0)
    assert abs(s.spread - 2 / 11) < 1e-12
    assert summarize([]) == EMPTY
    assert share_of([50.0, 60.0], 100.0).median == 0.55
    assert share_of([50.0], 0.0) == EMPTY  # no baseline: nothing to divide by


@given(st.lists(finite, min_size=1, max_size=30), st.floats(0, 100))
def test_a_summary_lies_within_its_values(values: list[float], q: float) -> None:
    s = summarize(values)
    assert s.low <= s.median <= s.high
    assert s.low <= percentile(values, q) <= s.high
    assert s.low - 1e-6 <= s.mean <= s.high + 1e-6
    assert s.spread >= 0


# -- records ------------------------------------------------------------------------------


def test_a_tenant_that_printed_no_result_is_an_error_that_keeps_its_words() -> None:
    crashed = TenantResult.parse("Segmentation fault (core dumped)", "victim")
    assert crashed.error.startswith("no result") and "Segmentation fault" in crashed.error
    assert crashed.role == "victim" and crashed.rate == 0.0
    assert TenantResult.parse("[1, 2]").error  # JSON, but not the worker's object
    good = TenantResult.parse(json.dumps({"rate": 12.5, "asked_mib": 100, "allocated_mib": 100,
                                          "stages": {"main": 0.1}}), "a")  # fmt: skip
    assert (good.rate, good.allocations_held, good.role, good.error) == (12.5, True, "a", "")
    refused = TenantResult(asked_mib=100, allocated_mib=64, alloc_error="CUDA_ERROR_OUT_OF_MEMORY")
    assert not refused.allocations_held


tenants = st.builds(
    TenantResult,
    rate=finite,
    asked_mib=st.integers(0, 1 << 20),
    allocated_mib=st.integers(0, 1 << 20),
    alloc_error=st.sampled_from(["", "CUDA_ERROR_OUT_OF_MEMORY"]),
    stages=st.dictionaries(st.sampled_from(["main", "init", "first_kernel"]), finite),
    error=st.text(max_size=20),
    role=st.sampled_from(["a", "b", "aggressor", "victim"]),
)


@given(st.builds(Measurement, scenario=st.sampled_from(["pair", "start"]),
                 backend=st.sampled_from(["mps", "driver"]), run=st.integers(0, 3),
                 tenants=st.lists(tenants, max_size=3).map(tuple),
                 hook_seconds=st.lists(finite, max_size=3).map(tuple),
                 error=st.text(max_size=10)))  # fmt: skip
def test_a_measurement_survives_the_results_file(m: Measurement) -> None:
    assert Measurement.from_json(json.loads(json.dumps(m.to_json()))) == m


# -- the report ---------------------------------------------------------------------------

BACKENDS = [
    Backend("time-sliced", "nothing", "time-slicing", True, ""),
    Backend("interposer", "HAMi-core", "HAMi-core SM limit", True, ""),
    Backend("mps", "", "", False, "no nvidia-cuda-mps-control on PATH"),
]


def run(scenario: str, backend: str, i: int, *rates: float) -> Measurement:
    roles = ["a", "b"]
    tenants = tuple(TenantResult(rate=r, role=roles[n]) for n, r in enumerate(rates))
    return Measurement(scenario, backend, i, tenants)


def measurements() -> list[Measurement]:
    return [
        run("dedicated", "none", 0, 100.0),
        run("dedicated", "none", 1, 100.0),
        run("alone", "time-sliced", 0, 99.0),
        run("pair", "time-sliced", 0, 50.0, 48.0),
        run("pair", "time-sliced", 1, 51.0, 49.0),
        run("alone", "interposer", 0, 50.0),
        run("pair", "interposer", 0, 40.0, 30.0),
        run("pair", "interposer", 1, 0.0, 0.0),  # failed below: left out of the shares
        Measurement("pair", "interposer", 2, (TenantResult(error="boom", role="b"),)),
        Measurement("pressure", "time-sliced", 0, (
            TenantResult(rate=90.0, asked_mib=150, allocated_mib=150, role="aggressor"),
            TenantResult(rate=10.0, asked_mib=80, allocated_mib=16,
                         alloc_error="CUDA_ERROR_OUT_OF_MEMORY", role="victim"))),
        Measurement("pressure", "interposer", 0, (
            TenantResult(rate=40.0, asked_mib=150, allocated_mib=100,
                         alloc_error="CUDA_ERROR_OUT_OF_MEMORY", role="aggressor"),
            TenantResult(rate=35.0, asked_mib=80, allocated_mib=80, role="victim"))),
        Measurement("start", "interposer", 0, (
            TenantResult(stages={"main": 0.1, "init": 0.5, "context": 0.9, "first_kernel": 1.0}),)),
        Measurement("start", "interposer", 1, (
            *(TenantResult(stages={"main": 0.1, "context": 1.0 + i, "first_kernel": 2.0 + i})
              for i in range(3)), TenantResult(error="killed"))),
        Measurement("start", "time-sliced", 0, (), hook_seconds=(0.25,)),
        run("control", "none", 0, 98.0),
    ]  # fmt: skip


def report() -> str:
    return table.build(["## a header"], BACKENDS, measurements(), share=50, share_mib=100,
                       crowd=4)  # fmt: skip


def row(text: str, first: str, section: str) -> list[str]:
    part = text[text.index(section) :]
    line = next(x for x in part.splitlines() if x.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_throughput_kept_is_each_tenant_and_both_against_the_dedicated_median() -> None:
    text = report()
    assert text.startswith("## a header\n")
    sliced = row(text, "time-sliced", "### Throughput kept")
    assert sliced[3:] == ["99.0 %", "50.5 % (50.0-51.0)", "48.5 % (48.0-49.0)",
                          "99.0 % (98.0-100.0)", "2"]  # fmt: skip
    interposer = row(text, "interposer", "### Throughput kept")
    # run 2 failed (a tenant's error): not a share; run 1 counted as measured, zero
    assert interposer[6:] == ["35.0 % (0.0-70.0)", "2"]
    absent = row(text, "mps", "### Throughput kept")
    assert absent[3] == "absent: no nvidia-cuda-mps-control on PATH"
    assert "dedicated again: 98.0 % of the first" in text
    assert ("HAMi-core with its SM limit against plain time-slicing, both tenants together: "
            "35.4 %.") in text  # fmt: skip
    assert "memory limit alone against" not in text  # not measured: not claimed
    for published in ("63.5 / 60.4 / 68.0 / 77.8 / 87.9 %", "44.5 / 45.0 / 51.2 / 61.6 / 72.8 %",
                      "within 1-2 %"):  # fmt: skip
        assert published in text


def test_isolation_says_whose_allocations_were_refused() -> None:
    text = report()
    sliced = row(text, "time-sliced", "### Isolation under pressure")
    assert sliced[1:5] == ["150", "nothing", "16 / 80", "REFUSED (CUDA_ERROR_OUT_OF_MEMORY)"]
    assert sliced[6] == "10.0 %"  # of dedicated
    held = row(text, "interposer", "### Isolation under pressure")
    assert held[1:5] == ["100", "CUDA_ERROR_OUT_OF_MEMORY", "80 / 80", "all held"]
    assert held[5] == "233.3 %"  # 35 against the pair runs' median rate (15 of 40/30/0/0)
    assert "(1.5 x its 100 MiB share)" in text


def test_start_costs_alone_and_in_a_crowd_with_failures_counted() -> None:
    text = report()
    cells = row(text, "interposer", "### What a start costs")
    assert cells[1:6] == ["1.00 s", "0.80 s", "3.00 s", "4.00 s", "1"]
    assert row(text, "time-sliced", "### What a start costs")[6] == "0.25 s"
    assert "| 4 at once: median |" in text


def test_what_failed_is_listed_last() -> None:
    text = report()
    failed = text[text.index("### What failed") :]
    assert "- pair interposer run 2: b: boom" in failed
    assert "- start interposer run 1: tenant: killed" in failed
