"""The chart's memory sizing for the extender covers what ``make scale`` measured.

values.yaml tells operators to size the extender's memory limit as a base plus so much
per pod in the cluster; docs/benchmarks.md holds the measured peak RSS of the
extender's start at each pod count. The formula must give at least every measured
peak, its worked examples must follow from it, and the default limit must hold the
formula at Kubernetes' documented limit of 150 000 pods."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
VALUES = ROOT / "charts" / "gpushare" / "values.yaml"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
MOST_PODS = 150_000

_MEBI = {"Mi": 1.0, "Gi": 1024.0}


def _formula() -> tuple[float, float]:
    """(base MiB, KiB per pod) from the values.yaml comment."""
    match = re.search(r"(\d+) MiB \+ (\d+) KiB x the pods in the cluster", VALUES.read_text())
    assert match, "values.yaml no longer states the extender's memory formula"
    return float(match[1]), float(match[2])


def _limit_mib(base: float, per_pod_kib: float, pods: int) -> float:
    return base + per_pod_kib * pods / 1024


def _measured() -> list[tuple[int, float]]:
    """(pods listed, peak RSS MB) rows of the scale table in docs/benchmarks.md."""
    text = BENCHMARKS.read_text()
    section = text.split("## Scale (`make scale`)", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| [\d.]+ \| (\d+) \|", section, re.MULTILINE)
    return [(int(pods), float(rss)) for pods, rss in rows]


def test_the_formula_covers_every_measured_start() -> None:
    base, per_pod = _formula()
    measured = _measured()
    assert any(pods >= MOST_PODS for pods, _ in measured), "150 000 pods is not measured"
    for pods, rss_mb in measured:
        # VmHWM is read in KiB and shown /1024: the table's MB are MiB
        assert _limit_mib(base, per_pod, pods) >= rss_mb, (pods, rss_mb)


def test_the_worked_examples_follow_the_formula() -> None:
    base, per_pod = _formula()
    text = VALUES.read_text()
    examples = re.search(
        r"e\.g\. 10 000 pods: (\d+)Mi; 50 000: (\d+)Mi; 150 000[^:]*: (\d+)Mi", text
    )
    assert examples
    for pods, shown in zip((10_000, 50_000, MOST_PODS), examples.groups(), strict=True):
        assert int(shown) >= _limit_mib(base, per_pod, pods)
        assert int(shown) - _limit_mib(base, per_pod, pods) < 10  # rounded up, not padded


def test_the_default_limit_holds_the_largest_cluster() -> None:
    base, per_pod = _formula()
    values = yaml.safe_load(VALUES.read_text())
    limit = values["scheduler"]["extenderResources"]["limits"]["memory"]
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", limit).groups()  # type: ignore[union-attr]
    assert int(number) * _MEBI[unit] >= _limit_mib(base, per_pod, MOST_PODS)
