"""The enforcement backend of each card, over every small world: driver version x cgroup
type x MIG x served whole x CDI x self-test x interposer x pin (memory and compute).

The properties: ``driver`` only where every fact allows it and the self-test passed; a
pin is given exactly or refused with a reason naming the obstacle (never a silent
downgrade); ``auto`` never refuses and takes the strongest backend some pin could have.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.config import matcher
from gpushare.share.backendchoice import (
    AUTO,
    COMPUTE_PINS,
    COMPUTE_PINS_PATTERN,
    COMPUTE_STRENGTH,
    MEMORY_PINS,
    MEMORY_PINS_PATTERN,
    MEMORY_STRENGTH,
    CardTraits,
    ComputeBackend,
    MemoryBackend,
    NodeFacts,
    PinRefused,
    Pins,
    check_pin_keys,
    choose,
    choose_all,
    parse_pins,
    wants_driver_probe,
)

VERSIONS = (None, "550.54.15", "614.99", "615.0.1", "620.10")
CGROUPS = ("v1", "v2", "none")
PROBES = (None, "", "read back 0 instead of 1048576")
UUID = "GPU-0000"


def worlds() -> itertools.product:  # type: ignore[type-arg]
    return itertools.product(
        VERSIONS,
        CGROUPS,
        (False, True),
        (False, True),
        (False, True),
        (False, True),
        PROBES,
        (False, True),
    )


def facts(
    version: str | None,
    cgroup: str,
    mig: bool,
    mig_slice: bool,
    whole: bool,
    cdi: bool,
    probe: str | None,
    interposer: bool,
) -> tuple[NodeFacts, CardTraits]:
    card = CardTraits(UUID, 0, mig, mig_slice, whole, cdi, probe)
    return NodeFacts(version, cgroup, interposer), card


def outcome(node: NodeFacts, card: CardTraits, memory: str, compute: str = AUTO) -> object:
    try:
        return choose(node, card, memory, compute)
    except PinRefused as exc:
        return exc


def driver_possible(node: NodeFacts, card: CardTraits) -> bool:
    major = int(node.driver_version.split(".")[0]) if node.driver_version else 0
    return (
        major >= 615
        and node.cgroup == "v2"
        and not card.mig
        and not card.mig_slice
        and not card.whole_only
        and card.cdi
        and card.probe == ""
    )


#: The obstacle each refusal of ``driver`` must name, in the order they are checked.
def expected_reason(node: NodeFacts, card: CardTraits) -> str:
    major = int(node.driver_version.split(".")[0]) if node.driver_version else 0
    if card.mig:
        return "MIG"
    if card.whole_only and not card.mig_slice:
        return "whole"
    if card.mig_slice:
        return "MIG"
    if card.whole_only:
        return "whole"
    if node.driver_version is None:
        return "driver version unknown"
    if major < 615:
        return "driver version"
    if node.cgroup != "v2":
        return "cgroup"
    if not card.cdi:
        return "CDI"
    return "self-test"


def test_memory_every_world() -> None:
    seen = set()
    for world in worlds():
        node, card = facts(*world)
        results = {pin: outcome(node, card, pin) for pin in MEMORY_PINS}
        for pin, result in results.items():
            if isinstance(result, PinRefused):
                message = str(result)
                assert "\n" not in message and pin != AUTO, (world, pin, message)
                assert f"card 0 ({UUID})" in message and f"to {pin}" in message
                if pin == "driver":
                    assert expected_reason(node, card) in message, (world, message)
                continue
            memory = result.memory  # type: ignore[attr-defined]
            seen.add(memory)
            if pin != AUTO:  # a pin is given exactly, never downgraded
                assert memory.value == pin, (world, pin, memory)
            if memory is MemoryBackend.DRIVER:
                assert driver_possible(node, card), world
            if memory is MemoryBackend.HARDWARE:
                assert card.mig or card.whole_only
        # auto: never refused, and the strongest backend that some pin could have
        auto = results[AUTO]
        assert not isinstance(auto, PinRefused), world
        given_by_pins = {
            r.memory
            for p, r in results.items()
            if p != AUTO and not isinstance(r, PinRefused)  # type: ignore[attr-defined]
        }
        candidates = given_by_pins or {MemoryBackend.NONE}
        strongest = min(candidates, key=MEMORY_STRENGTH.index)
        assert auto.memory is strongest, (world, auto, candidates)  # type: ignore[attr-defined]
        if driver_possible(node, card):
            assert auto.memory is MemoryBackend.DRIVER  # type: ignore[attr-defined]
        if (
            not node.interposer
            and not (card.mig or card.whole_only)
            and not driver_possible(node, card)
        ):
            assert auto.memory is MemoryBackend.NONE  # type: ignore[attr-defined]
    assert seen == set(MemoryBackend) - {MemoryBackend.SOFT}  # SOFT: MPS cards only


def test_compute_every_world() -> None:
    for world in worlds():
        node, card = facts(*world)
        results = {pin: outcome(node, card, AUTO, pin) for pin in COMPUTE_PINS}
        for pin, result in results.items():
            if isinstance(result, PinRefused):
                assert pin != AUTO and "\n" not in str(result)
                if pin == "mps":
                    assert (
                        "no MPS control daemon" in str(result)
                        or "MIG" in str(result)
                        or ("whole" in str(result))
                    )
                continue
            compute = result.compute  # type: ignore[attr-defined]
            if pin != AUTO:
                assert compute.value == pin, (world, pin)
            assert compute is not ComputeBackend.MPS  # no control daemon in these worlds
            if compute is ComputeBackend.HARDWARE:
                assert card.mig or card.whole_only
        auto = results[AUTO]
        given_by_pins = {
            r.compute
            for p, r in results.items()
            if p != AUTO and not isinstance(r, PinRefused)  # type: ignore[attr-defined]
        }
        strongest = min(given_by_pins, key=COMPUTE_STRENGTH.index)
        assert auto.compute is strongest, world  # type: ignore[attr-defined]


def test_probe_is_asked_exactly_where_driver_could_be_chosen() -> None:
    for world in worlds():
        node, card = facts(*world)
        for pin in MEMORY_PINS:
            untested = replace(card, probe=None)
            wants = wants_driver_probe(node, untested, pin)
            passed = replace(card, probe="")
            could = not isinstance(outcome(node, passed, "driver"), PinRefused)
            assert wants == (could and pin in (AUTO, "driver")), (world, pin)
            if not wants and pin == AUTO:  # no test run: auto still decides
                assert outcome(node, untested, AUTO).memory is not MemoryBackend.DRIVER  # type: ignore[attr-defined]


def test_an_untested_card_is_not_given_driver() -> None:
    node = NodeFacts("615.0", "v2", True)
    card = CardTraits(UUID, 0, cdi=True)
    assert choose(node, card, AUTO, AUTO).memory is MemoryBackend.INTERPOSER
    with pytest.raises(PinRefused, match="self-test was not run"):
        choose(node, card, "driver", AUTO)


def test_pins_per_card_win_over_the_node_wide_one() -> None:
    pins = parse_pins("interposer, 1=driver , GPU-b=hardware", MEMORY_PINS)
    assert pins.node == "interposer"
    assert pins.for_card("GPU-a", 1) == "driver"
    assert pins.for_card("GPU-b", 1) == "hardware"  # the UUID wins over the index
    assert pins.for_card("GPU-c", 2) == "interposer"
    assert parse_pins("", MEMORY_PINS) == Pins(AUTO, {})
    assert parse_pins("DRIVER", MEMORY_PINS).node == "driver"


@pytest.mark.parametrize(
    "text, why",
    [
        ("driver,interposer", "two node-wide"),
        ("0=driver,0=interposer", "twice"),
        ("0=mps", "not one of"),
        ("fast", "not one of"),
        ("0 1=driver", "is not <card index"),
    ],
)
def test_bad_pins_are_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_pins(text, MEMORY_PINS)


def test_a_pin_naming_no_card_is_refused() -> None:
    with pytest.raises(ValueError, match="names no GPU of this node: 7"):
        check_pin_keys(parse_pins("7=driver", MEMORY_PINS), [("GPU-a", 0)], "memoryEnforcement")
    check_pin_keys(parse_pins("0=driver,GPU-a=driver", MEMORY_PINS), [("GPU-a", 0)], "m")


WORDS = st.sampled_from([*MEMORY_PINS, *COMPUTE_PINS, "Driver", "x", ""])
KEYS = st.sampled_from(["", "0", "GPU-a", "1 ", " 2", "a b", "=", "GPU-a="])


@given(st.lists(st.tuples(KEYS, WORDS), max_size=4), st.sampled_from([",", " , ", ",,"]))
def test_the_pattern_accepts_what_parses(entries: list[tuple[str, str]], comma: str) -> None:
    text = comma.join(f"{k}={w}" if k else w for k, w in entries)
    for words, pattern in (
        (MEMORY_PINS, MEMORY_PINS_PATTERN),
        (COMPUTE_PINS, COMPUTE_PINS_PATTERN),
    ):
        matches = matcher(pattern).search(text) is not None
        try:
            parse_pins(text, words)
        except ValueError as exc:
            assert not matches or re.search("twice|two node-wide", str(exc)), (text, exc)
        else:
            assert matches, text


def test_choose_all_uses_each_cards_pin() -> None:
    node = NodeFacts("620.1", "v2", True)
    cards = [CardTraits("GPU-a", 0, cdi=True, probe=""), CardTraits("GPU-b", 1, cdi=True, probe="")]
    choices = choose_all(node, cards, parse_pins("1=interposer", MEMORY_PINS), Pins())
    assert [c.memory for c in choices] == [MemoryBackend.DRIVER, MemoryBackend.INTERPOSER]
    assert [c.compute for c in choices] == [ComputeBackend.INTERPOSER] * 2
