"""A lint of Prometheus text exposition, by the rules ``promtool check metrics`` applies.

Written here (no Go tool in the test suite): every family has HELP and TYPE before its
samples and is declared once; counters end in ``_total`` and nothing else does;
``_count``/``_sum``/``_bucket`` only for histograms and summaries; snake_case names that
do not name their type; units in base units (seconds, bytes, ...), as the name's suffix
(before a counter's ``_total`` or a histogram's ``_bucket``/``_sum``/``_count``), never
abbreviated; no series (name and label set) twice. :func:`problems` returns one line per
finding, empty when the text is clean.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

BASE_UNITS = ("seconds", "bytes", "meters", "metres", "grams", "volts", "amperes",
              "joules", "celsius", "kelvin", "ratio")  # fmt: skip
PREFIXES = ("pico", "nano", "micro", "milli", "centi", "deci", "deca", "hecto", "kilo",
            "kibi", "mega", "mebi", "giga", "gibi", "tera", "tebi", "peta", "pebi")  # fmt: skip
#: Abbreviations promtool asks to spell out (``_ms``: ``_milliseconds``, and then seconds).
ABBREVIATIONS = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "kib",
                 "mib", "gib", "m", "h", "d")  # fmt: skip
NOT_BASE = {"minutes": "seconds", "hours": "seconds", "days": "seconds", "bits": "bytes"}
TYPES = ("counter", "gauge", "histogram", "summary", "untyped", "info", "stateset",
         "gaugehistogram", "unknown")  # fmt: skip
NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
SAMPLE_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"),
                   "counter": ("",)}  # fmt: skip


@dataclass
class Family:
    name: str
    help: str | None = None
    type: str | None = None
    samples: list[tuple[str, tuple[tuple[str, str], ...]]] = field(default_factory=list)


def parse(text: str) -> tuple[list[Family], list[str]]:
    """The families in order of appearance, and problems found while reading."""
    families: dict[str, Family] = {}
    order: list[Family] = []
    errors: list[str] = []
    current: Family | None = None

    def family(name: str, declaring: str) -> Family:
        nonlocal current
        found = families.get(name)
        if found is None:
            found = families[name] = Family(name)
            order.append(found)
        elif found is not current:
            errors.append(f"{name}: {declaring} again, apart from its family (declared twice)")
        current = found
        return found

    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                target = family(parts[2], parts[1])
                value = parts[3] if len(parts) > 3 else ""
                if parts[1] == "HELP":
                    if target.help is not None:
                        errors.append(f"{target.name}: two HELP lines")
                    target.help = value
                else:
                    if target.type is not None:
                        errors.append(f"{target.name}: two TYPE lines")
                    if value not in TYPES:
                        errors.append(f"{target.name}: unknown TYPE {value!r}")
                    target.type = value
            continue
        match = NAME.match(line)
        if match is None:
            errors.append(f"line {number}: not a sample: {line[:80]!r}")
            continue
        name, rest = match.group(), line[match.end() :]
        labels: list[tuple[str, str]] = []
        if rest.startswith("{"):
            body, _, rest = rest[1:].partition("}")
            position = 0
            while position < len(body):
                label = LABEL.match(body, position)
                if label is None:
                    errors.append(f"line {number}: bad labels {body[:80]!r}")
                    break
                labels.append((label.group(1), label.group(2)))
                position = label.end()
        if not rest.strip():
            errors.append(f"line {number}: {name} has no value")
        owner = _owner(name, current)
        if owner is None:
            errors.append(f"{name}: a sample outside its family (no HELP/TYPE before it)")
            owner = family(name, "sampled")
        owner.samples.append((name, tuple(sorted(labels))))
    return order, errors


def _owner(sample: str, current: Family | None) -> Family | None:
    """The family a sample line belongs to: the one declared just before it."""
    if current is None:
        return None
    if sample == current.name:
        return current
    kind = current.type or "untyped"
    for suffix in SAMPLE_SUFFIXES.get(kind, ()):
        if suffix and sample == current.name + suffix:
            return current
    if kind == "counter" and sample == current.name + "_total":
        return current
    return None


def _name_problems(family: Family) -> list[str]:
    name, kind = family.name, family.type or "untyped"
    found: list[str] = []
    if name != name.lower() or re.search(r"[a-z][A-Z]", name):
        found.append(f"{name}: names are snake_case, not camelCase")
    sampled = {sample for sample, _ in family.samples}
    exposed = name + "_total" if kind == "counter" and name + "_total" in sampled else name
    if kind == "counter" and not exposed.endswith("_total"):
        found.append(f"{name}: a counter's name ends in _total")
    if kind != "counter" and name.endswith("_total"):
        found.append(f"{name}: a {kind} must not end in _total (only counters do)")
    if kind not in ("histogram", "summary") and name.endswith(("_count", "_sum", "_bucket")):
        found.append(f"{name}: _count, _sum and _bucket are for histograms and summaries")
    words = exposed.removesuffix("_total").split("_")
    for typename in ("gauge", "counter", "histogram", "summary"):
        if typename in words:
            found.append(f"{name}: the name should not name its type ({typename})")
    for index, word in enumerate(words):
        if word in ABBREVIATIONS and index > 0:
            found.append(f"{name}: spell the unit out, not {word!r}")
        if word in NOT_BASE:
            found.append(f"{name}: use the base unit {NOT_BASE[word]}, not {word}")
        for prefix in PREFIXES:
            if word.startswith(prefix) and word[len(prefix) :] in BASE_UNITS:
                found.append(f"{name}: use the base unit {word[len(prefix):]}, not {word}")
        if word in BASE_UNITS and index != len(words) - 1:
            found.append(f"{name}: the unit ({word}) is the name's suffix")
    return found


def problems(text: str, deprecated: Iterable[str] = ()) -> list[str]:
    """Every finding in ``text``; families named in ``deprecated`` (kept under an old name
    for a release) are excused the naming rules, not HELP, TYPE or duplicates."""
    excused = set(deprecated)
    families, found = parse(text)
    for family in families:
        if not family.help:
            found.append(f"{family.name}: no HELP")
        if family.type is None:
            found.append(f"{family.name}: no TYPE")
        if family.name not in excused:
            found.extend(_name_problems(family))
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for series in family.samples:
            if series in seen:
                found.append(f"{series[0]}{dict(series[1])}: the same series twice")
            seen.add(series)
    return found
