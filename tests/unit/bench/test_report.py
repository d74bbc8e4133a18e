"""gpushare.bench.report: the quick plan is smaller than the full one in every count,
the table marks each row met, missed or information only, and the percentile is the
nearest rank."""

from __future__ import annotations

from dataclasses import fields

import pytest

from gpushare.bench.report import FULL, QUICK, Report, ms, percentile


def test_the_quick_plan_is_smaller_in_every_count() -> None:
    for field in fields(FULL):
        assert getattr(QUICK, field.name) < getattr(FULL, field.name), field.name


def test_the_table_marks_each_row_and_lists_the_missed() -> None:
    report = Report()
    report.add("a", "1 ms", "< 2 ms", ok=True)
    report.add("b", "3 ms", "< 2 ms", "1 ms", ok=False)
    report.add("c", "7", "")
    lines = report.table().splitlines()
    assert lines[0] == "| figure | measured | target | baseline (same run) | met |"
    assert lines[2:] == [
        "| a | 1 ms | < 2 ms |  | yes |",
        "| b | 3 ms | < 2 ms | 1 ms | **NO** |",
        "| c | 7 |  |  | - |",
    ]
    assert [row.figure for row in report.missed] == ["b"]


@pytest.mark.parametrize(("q", "expected"), [(0, 1.0), (50, 3.0), (90, 5.0), (99, 5.0), (100, 5.0)])
def test_the_percentile_is_the_nearest_rank(q: float, expected: float) -> None:
    assert percentile([5.0, 1.0, 4.0, 2.0, 3.0], q) == expected


def test_milliseconds_have_two_decimals() -> None:
    assert ms(0.0012345) == "1.23 ms"
