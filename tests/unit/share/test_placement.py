"""The placement policy as pure functions: the rules of docs/placement.md."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.share.devices import Resource
from gpushare.share.placement import (
    BINPACK,
    SPREAD,
    CandidateCard,
    Need,
    Policy,
    Request,
    Room,
    best,
    choose_card,
    place_containers,
    place_pod,
    preferred_units,
    rank,
)


def card(
    i: int, free: int, memory_free: int, core_free: int, healthy: bool = True
) -> CandidateCard:
    return CandidateCard(f"GPU-{i}", i, tuple(range(free)), memory_free, core_free, healthy)


def memory_card(i: int, memory_free: int, core_free: int = 100) -> CandidateCard:
    return card(i, memory_free, memory_free, core_free)


def core_card(i: int, memory_free: int, core_free: int) -> CandidateCard:
    return card(i, core_free, memory_free, core_free)


def test_binpack_takes_the_fullest_card_that_fits_and_spread_the_emptiest() -> None:
    cards = [memory_card(0, 10), memory_card(1, 4), memory_card(2, 20)]
    request = Request(Resource.MEMORY, 4, other_need=0)
    assert choose_card(cards, request, BINPACK) == cards[1]
    assert choose_card(cards, request, SPREAD) == cards[2]
    assert choose_card(cards, Request(Resource.MEMORY, 5, other_need=0), BINPACK) == cards[0]


def test_unhealthy_cards_are_never_chosen_while_a_healthy_one_fits() -> None:
    cards = [card(0, 10, 10, 100, healthy=False), memory_card(1, 12)]
    assert choose_card(cards, Request(Resource.MEMORY, 4), BINPACK) == cards[1]


def test_the_partner_card_wins_when_it_fits() -> None:
    cards = [core_card(0, 5, 50), core_card(1, 20, 100)]
    assert choose_card(cards, Request(Resource.CORE, 30, partner="GPU-0"), BINPACK) == cards[0]
    # ... but not when it cannot hold the request: the binder then refuses in Allocate.
    assert choose_card(cards, Request(Resource.CORE, 60, partner="GPU-0"), BINPACK) == cards[1]


def test_unknown_second_request_goes_where_it_has_most_room() -> None:
    cards = [core_card(0, 2, 100), core_card(1, 9, 100), core_card(2, 9, 10)]
    assert choose_card(cards, Request(Resource.CORE, 20), BINPACK) == cards[1]


def test_known_second_request_is_packed_among_cards_that_hold_both() -> None:
    cards = [core_card(0, 2, 100), core_card(1, 9, 100), core_card(2, 5, 100)]
    assert choose_card(cards, Request(Resource.CORE, 20, other_need=4), BINPACK) == cards[2]
    assert choose_card(cards, Request(Resource.CORE, 20, other_need=4), SPREAD) == cards[1]


def test_a_card_of_unknown_room_is_tried_before_cards_known_to_lack_it() -> None:
    """Issue 32.14 (a): no card the records vouch for holds the 9 memory units that
    follow these cores; GPU-2's memory is unknown (its offer shows holders the records
    do not list) but may be free: it is chosen, whatever the policy, over GPU-0 and
    GPU-1 (2 units each), where the memory would surely be refused. A card whose bound
    is too small is no better than a full one."""
    for policy in Policy:
        cards = [
            core_card(0, 2, 70),
            core_card(1, 2, 70),
            replace(core_card(2, 0, 70), other_at_most=29),
        ]
        request = Request(Resource.CORE, 10, other_need=9)
        assert choose_card(cards, request, policy) == cards[2]
        small = [*cards[:2], replace(cards[2], other_at_most=8)]
        chosen = choose_card(small, request, policy)
        # nothing may fit: the policy alone, as before (binpack: the fullest)
        assert chosen is not None and chosen.uuid == ("GPU-2" if policy is BINPACK else "GPU-0")
        fits = [replace(cards[0], memory_free=9), *cards[1:]]
        assert choose_card(fits, request, policy) == fits[0]  # a known fit comes first


@given(
    st.lists(
        st.tuples(st.integers(0, 12), st.integers(0, 12), st.none() | st.integers(0, 12)),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 12),
    st.sampled_from(list(Policy)),
)
def test_a_known_fit_then_a_possible_fit_is_chosen_whenever_one_exists(
    shapes: list[tuple[int, int, int | None]], need: int, policy: Policy
) -> None:
    """Cards with (free cores, free memory known, at most free memory where unknown):
    the container's 10 cores and ``need`` memory units go to a card known to hold both
    if there is one, else to one that may, else anywhere the cores fit."""
    cards = [
        CandidateCard(f"GPU-{i}", i, tuple(range(cores * 10)), 0 if most is not None else mem,
                      cores * 10, other_at_most=most)
        for i, (cores, mem, most) in enumerate(shapes)
    ]  # fmt: skip
    request = Request(Resource.CORE, 10, other_need=need)
    chosen = choose_card(cards, request, policy)
    assert chosen is not None
    eligible = [c for c in cards if len(c.free_units) >= 10]
    if any(c.memory_free >= need for c in eligible):
        assert chosen.memory_free >= need
    elif any(c.other_at_most is not None and c.other_at_most >= need for c in eligible):
        assert chosen.other_at_most is not None and chosen.other_at_most >= need


def test_must_include_units_pin_the_card_and_come_first() -> None:
    cards = [memory_card(0, 10), memory_card(1, 4)]
    request = Request(Resource.MEMORY, 3, must_include={"GPU-0": [7]})
    chosen = choose_card(cards, request, BINPACK)
    assert chosen == cards[0]
    assert preferred_units(chosen, request) == [7, 0, 1]


def test_nothing_fits_gives_the_roomiest_card_for_allocate_to_refuse() -> None:
    cards = [memory_card(0, 3), memory_card(1, 6)]
    assert choose_card(cards, Request(Resource.MEMORY, 8), BINPACK) == cards[1]
    assert choose_card([], Request(Resource.MEMORY, 1), BINPACK) is None


cards_strategy = st.lists(
    st.tuples(st.integers(0, 30), st.integers(0, 100), st.booleans()), min_size=1, max_size=8
)


@given(
    cards_strategy,
    st.sampled_from(list(Resource)),
    st.integers(1, 100),
    st.integers(1, 30),
    st.sampled_from([BINPACK, SPREAD]),
)
def test_first_placement_never_rules_out_a_card_that_holds_both(
    spec: list[tuple[int, int, bool]],
    first: Resource,
    first_size: int,
    second_size: int,
    policy: str,
) -> None:
    """Whatever comes first, if some card holds both requests, the chosen one does."""
    memory_need, core_need = (
        (first_size, second_size) if first is Resource.MEMORY else (second_size, first_size)
    )
    views = [
        card(i, memory if first is Resource.MEMORY else core, memory, core, healthy)
        for i, (memory, core, healthy) in enumerate(spec)
    ]
    chosen = choose_card(views, Request(first, first_size), policy)
    assert chosen is not None
    feasible = [
        v for v in views if v.healthy and v.memory_free >= memory_need and v.core_free >= core_need
    ]
    if feasible:
        assert chosen.memory_free >= memory_need and chosen.core_free >= core_need
        assert chosen.healthy


# -- pods as a whole ---------------------------------------------------------------

rooms_strategy = st.lists(
    st.tuples(st.integers(0, 8), st.integers(0, 100), st.booleans()), min_size=1, max_size=3
)
needs_strategy = st.lists(
    st.tuples(st.integers(0, 6), st.sampled_from([0, 10, 40, 70, 100])).filter(any),
    min_size=1,
    max_size=4,
)


def _rooms(spec: list[tuple[int, int, bool]]) -> list[Room]:
    return [Room(f"GPU-{i}", i, m, c, h) for i, (m, c, h) in enumerate(spec)]


def _valid(rooms: list[Room], needs: list[Need], cards: tuple[str, ...]) -> bool:
    left = {r.uuid: [r.memory_free, r.core_free] for r in rooms if r.healthy}
    for need, uuid in zip(needs, cards, strict=True):
        if uuid not in left:
            return False
        left[uuid][0] -= need.memory
        left[uuid][1] -= need.core
    return all(m >= 0 and c >= 0 for m, c in left.values())


@given(rooms_strategy, needs_strategy, st.sampled_from(list(Policy)))
def test_a_pod_is_placed_whenever_any_assignment_exists(
    spec: list[tuple[int, int, bool]], raw: list[tuple[int, int]], policy: Policy
) -> None:
    """Exhaustive over all assignments of this small world: the search finds one if any exists."""
    rooms = _rooms(spec)
    needs = [Need(m, c) for m, c in raw]
    placed = place_containers(rooms, needs, policy)
    exists = any(
        _valid(rooms, needs, combo)
        for combo in itertools.product([r.uuid for r in rooms], repeat=len(needs))
    )
    assert (placed is not None) == exists
    if placed is not None:
        assert _valid(rooms, needs, placed)


@given(rooms_strategy, needs_strategy, st.sampled_from(list(Policy)))
def test_placing_the_first_container_then_the_rest_gives_the_same_cards(
    spec: list[tuple[int, int, bool]], raw: list[tuple[int, int]], policy: Policy
) -> None:
    """The daemon re-plans at every container; the extender plans once: they must agree."""
    rooms = _rooms(spec)
    needs = [Need(m, c) for m, c in raw]
    placed = place_containers(rooms, needs, policy)
    if placed is None:
        return
    current = rooms
    for position, need in enumerate(needs):
        again = place_containers(current, needs[position:], policy)
        assert again == placed[position:]
        current = [r.minus(need) if r.uuid == placed[position] else r for r in current]


@given(rooms_strategy, needs_strategy, needs_strategy, st.sampled_from(list(Policy)))
def test_a_pod_placed_whole_names_the_container_that_stops_it(
    spec: list[tuple[int, int, bool]],
    raw_init: list[tuple[int, int]],
    raw: list[tuple[int, int]],
    policy: Policy,
) -> None:
    """place_pod: the init containers each alone, then place_containers' answer; where
    the pod does not fit, the first init container with no card, else the first
    container that finds none once those before it took their best cards."""
    rooms = _rooms(spec)
    init_needs = [Need(m, c) for m, c in raw_init]
    needs = [Need(m, c) for m, c in raw]
    plan = place_pod(rooms, init_needs, needs, policy)
    lonely = [i for i, need in enumerate(init_needs) if best(rooms, need, policy) is None]
    if lonely:
        assert plan.cards is None and plan.init_misfit == lonely[0]
        return
    assert plan.init_misfit is None
    assert plan.cards == place_containers(rooms, needs, policy)
    if plan.cards is not None:
        assert plan.misfit is None and plan.placed == ()
        return
    current = list(rooms)
    for position, need in enumerate(needs):
        chosen = best(current, need, policy)
        if chosen is None:
            assert plan.misfit == position
            assert len(plan.placed) == position
            return
        assert plan.placed[position] == chosen.uuid
        current = [r.minus(need) if r.uuid == chosen.uuid else r for r in current]
    assert plan.misfit is None  # each fits alone in turn, yet the search found no whole


def test_two_identical_containers_are_placed_for_the_pod() -> None:
    # Binpack alone would put c1 on GPU-0 (fullest that holds it), leaving no room for c2.
    rooms = [Room("GPU-0", 0, 6, 100), Room("GPU-1", 1, 4, 100)]
    needs = [Need(4, 10), Need(4, 95)]
    assert place_containers(rooms, needs, Policy.BINPACK) == ("GPU-1", "GPU-0")
    assert rank(rooms, needs[0], Policy.BINPACK)[0].uuid == "GPU-1"
    rooms = [Room("GPU-0", 0, 6, 70), Room("GPU-1", 1, 20, 100)]
    assert place_containers(rooms, needs, Policy.BINPACK) == ("GPU-0", "GPU-1")


def test_policy_names_parse_and_refuse_nonsense() -> None:
    assert Policy.parse("BinPack") is Policy.BINPACK
    with pytest.raises(ValueError, match="unknown placement policy"):
        Policy.parse("random")
