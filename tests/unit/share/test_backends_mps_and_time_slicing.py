"""``mps`` in the one backend decision (share/backendchoice.py), over every small world with an
MPS control daemon present or not, and time-sliced cards: MPS only where the node has the
control daemon and the card is shared; on an MPS card the interposer never holds memory
(the driver's limit where it can, otherwise MPS's pinned limit, shown ``soft``); a
time-sliced card has no limits and refuses every pin but auto (and none for compute)."""

from __future__ import annotations

import itertools

from test_backends_enforcement import facts, outcome, worlds

from gpushare.share.backendchoice import (
    AUTO,
    COMPUTE_PINS,
    MEMORY_PINS,
    CardTraits,
    ComputeBackend,
    MemoryBackend,
    NodeFacts,
    PinRefused,
    choose,
)


def with_mps(node: NodeFacts) -> NodeFacts:
    return NodeFacts(node.driver_version, node.cgroup, node.interposer, mps=True)


def test_mps_every_world() -> None:
    seen_memory = set()
    for world, mps in itertools.product(worlds(), (False, True)):
        node, card = facts(*world)
        if mps:
            node = with_mps(node)
        for memory_pin, compute_pin in itertools.product(MEMORY_PINS, COMPUTE_PINS):
            result = outcome(node, card, memory_pin, compute_pin)
            if isinstance(result, PinRefused):
                assert "\n" not in str(result)
                assert (memory_pin, compute_pin) != (AUTO, AUTO), (world, mps)
                if compute_pin == "mps" and not mps and memory_pin == AUTO:
                    assert "no MPS control daemon" in str(result) or (
                        "MIG" in str(result) or "whole" in str(result)
                    )
                continue
            compute, memory = result.compute, result.memory  # type: ignore[attr-defined]
            if compute is ComputeBackend.MPS:
                assert mps and not (card.mig or card.whole_only)
                # never the interposer beside MPS; soft only where driver is not had
                assert memory in (MemoryBackend.DRIVER, MemoryBackend.SOFT), (world, memory)
                assert memory_pin != "interposer"
            if memory is MemoryBackend.SOFT:
                assert compute is ComputeBackend.MPS
                assert "a client can drop it" in result.memory_reason  # type: ignore[attr-defined]
            seen_memory.add(memory)
        auto = choose(node, card, AUTO, AUTO)
        if mps and not (card.mig or card.whole_only):
            assert auto.compute is ComputeBackend.MPS  # auto takes it where configured
    assert MemoryBackend.SOFT in seen_memory


def test_timeslice_card_has_no_limits_and_refuses_pins() -> None:
    for world, mps in itertools.product(worlds(), (False, True)):
        node, card = facts(*world)
        if card.mig or card.mig_slice or card.whole_only:
            continue
        node = with_mps(node) if mps else node
        card = CardTraits(card.uuid, card.index, cdi=card.cdi, probe=card.probe, timeslice=True)
        auto = choose(node, card, AUTO, AUTO)
        assert (auto.memory, auto.compute) == (MemoryBackend.NONE, ComputeBackend.NONE)
        assert choose(node, card, AUTO, "none").compute is ComputeBackend.NONE
        for pin in MEMORY_PINS[1:]:
            refused = outcome(node, card, pin)
            assert isinstance(refused, PinRefused) and "time-sliced" in str(refused)
        for pin in ("mps", "interposer", "hardware"):
            refused = outcome(node, card, AUTO, pin)
            assert isinstance(refused, PinRefused) and "time-sliced" in str(refused)
