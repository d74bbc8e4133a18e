"""The partner decision table of docs/placement.md, row by row, on plain data."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from gpushare.share.devices import Resource
from gpushare.share.pairing import PAIR_WINDOW, Basis, Binding, Facts, decide
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder

MEMORY, CORE = Resource.MEMORY, Resource.CORE
A = Holder("default", "a", "main")
LAST = Binding(MEMORY, "GPU-0", ("GPU-0::0", "GPU-0::1"), at=100.0)


def records(held: Mapping[Resource, list[str]], holder: Holder = A) -> Snapshot:
    snapshot = Snapshot(100.5)
    for resource, ids in held.items():
        snapshot.devices.setdefault(holder, {})[resource] = list(ids)
        for device_id in ids:
            snapshot.holders[(resource, device_id)] = holder
    return snapshot


def specs(wanted: Mapping[Resource, int] | None):  # type: ignore[no-untyped-def]
    return lambda holder: wanted if holder == A else None


HOLDS_MEMORY = {MEMORY: list(LAST.device_ids)}

ROWS = [
    ("nothing bound", None, CORE, Facts(), Basis.NOTHING_TO_PAIR, False),
    ("same resource again", LAST, MEMORY, Facts(), Basis.NOTHING_TO_PAIR, False),
    ("no records", LAST, CORE, Facts(None, "socket missing"), Basis.FALLBACK, True),
    (
        "holder complete",
        LAST,
        CORE,
        Facts(records({**HOLDS_MEMORY, CORE: ["GPU-0::5"]})),
        Basis.COMPLETE,
        False,
    ),
    (
        "spec wants it",
        LAST,
        CORE,
        Facts(records(HOLDS_MEMORY), specs=specs({MEMORY: 2, CORE: 30})),
        Basis.PARTNER,
        True,
    ),
    (
        "spec does not want it",
        LAST,
        CORE,
        Facts(records(HOLDS_MEMORY), specs=specs({MEMORY: 2})),
        Basis.NOT_WANTED,
        False,
    ),
    (
        "spec unknown",
        LAST,
        CORE,
        Facts(records(HOLDS_MEMORY), specs=specs(None)),
        Basis.FALLBACK,
        True,
    ),
    (
        "spec of another size",
        LAST,
        CORE,
        Facts(records(HOLDS_MEMORY), specs=specs({MEMORY: 2, CORE: 99})),
        Basis.FALLBACK,
        True,
    ),
    (
        "records disagree",
        LAST,
        CORE,
        Facts(records({MEMORY: ["GPU-0::0"]}), specs=specs({MEMORY: 2, CORE: 30})),
        Basis.FALLBACK,
        True,
    ),
    (
        "released, no init container waits",
        LAST,
        CORE,
        Facts(records({}), specs=specs(None), init_waiting=lambda *_: False),
        Basis.RELEASED,
        False,
    ),
    (
        "not listed, an init container may be asking",
        LAST,
        CORE,
        Facts(records({}), specs=specs(None), init_waiting=lambda *_: True),
        Basis.FALLBACK,
        True,
    ),
    ("not listed, no specs", LAST, CORE, Facts(records({})), Basis.FALLBACK, True),
]


@pytest.mark.parametrize(("row", "last", "resource", "facts", "basis", "partner"), ROWS)
def test_decision_table(
    row: str, last: Binding | None, resource: Resource, facts: Facts, basis: Basis, partner: bool
) -> None:
    decision = decide(last, PAIR_WINDOW, resource, 30, 100.5, facts)
    assert decision.basis is basis, row
    assert (decision.partner is not None) == partner, row
    if partner:
        assert decision.partner == last
    assert decision.from_facts == (basis is not Basis.FALLBACK)


def test_age_ends_only_the_fallback_never_what_the_facts_show() -> None:
    late = LAST.at + PAIR_WINDOW + 0.1
    facts = Facts(records(HOLDS_MEMORY), specs=specs({MEMORY: 2, CORE: 30}))
    assert decide(LAST, PAIR_WINDOW, CORE, 30, late, facts).basis is Basis.PARTNER
    decision = decide(LAST, PAIR_WINDOW, CORE, 30, late, Facts(None, "socket missing"))
    assert decision.basis is Basis.EXPIRED and decision.partner is None
