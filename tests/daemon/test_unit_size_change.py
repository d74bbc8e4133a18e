"""Changing --memory-unit-mib under running containers never double-books."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import CARD_4GIB, Node, cards, gpu_uuid
from hypothesis import given
from hypothesis import strategies as st
from kit.sizes import at_two_sizes

from gpushare.base.startup import StartupError
from gpushare.daemon import Daemon
from gpushare.host.unitguard import UnitSizeChanged, check_unit_size
from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder
from gpushare.sim.kubeletdouble import AdmissionError


def restart_with(node: Node, **overrides: object) -> Daemon:
    if node.daemon is not None:
        node.daemon.stop()
    node.daemon = None
    node.settings = replace(node.settings, **overrides)  # type: ignore[arg-type]
    daemon = Daemon(node.settings)
    daemon.start()
    node.daemon = daemon
    return daemon


def test_a_smaller_unit_under_a_running_container_is_refused_naming_it(node: Node) -> None:
    node.start(cards(CARD_4GIB, 1), memory_unit_mib=1024)
    node.kubelet.admit("old", "main", {node.memory: 2})  # 2048 MiB of 4096
    with pytest.raises(StartupError) as error:
        restart_with(node, memory_unit_mib=256)
    message = str(error.value)
    assert error.value.exit_code == 2
    assert "from 1024 to 256" in message and "default/old/main" in message
    assert "set --memory-unit-mib 1024" in message
    # nothing was registered at the wrong size: the kubelet still sees 1024 MiB units
    assert len(node.kubelet.devices(node.memory)) == 4

    # the old size still starts, and the card is not double-booked
    restart_with(node, memory_unit_mib=1024)
    assert node.wait_registered()
    with pytest.raises(AdmissionError):
        node.kubelet.admit("new", "main", {node.memory: 3})


def test_the_new_size_is_taken_once_no_container_holds_memory(node: Node) -> None:
    node.start(cards(CARD_4GIB, 1), memory_unit_mib=1024)
    node.kubelet.admit("old", "main", {node.memory: 2})
    node.kubelet.admit("core-only", "main", {node.core: 50})  # holds no memory: no matter
    node.kubelet.release("old")
    restart_with(node, memory_unit_mib=256)
    assert node.kubelet.wait_for(lambda k: len(k.devices(node.memory)) == 16)


def test_without_a_record_units_past_the_end_prove_a_change(node: Node) -> None:
    node.start(cards(CARD_4GIB, 1), memory_unit_mib=256)
    node.kubelet.admit("old", "main", {node.memory: 12})  # units 0..11 (or any 12 of 16)
    (node.root / "vgpu" / "memory-unit.json").unlink()  # as left by an older daemon
    with pytest.raises(StartupError, match="default/old/main"):
        restart_with(node, memory_unit_mib=1024)  # 4 units: numbers >= 4 cannot exist


def snapshot_of(held: dict[str, list[int]]) -> Snapshot:
    snapshot = Snapshot(0.0)
    for pod, numbers in held.items():
        holder = Holder("ns", pod, "c")
        ids = [f"{gpu_uuid(0)}::{n}" for n in numbers]
        snapshot.devices[holder] = {Resource.MEMORY: ids}
        for device_id in ids:
            snapshot.holders[(Resource.MEMORY, device_id)] = holder
    return snapshot


@at_two_sizes(
    given(
        recorded=st.sampled_from([None, 128, 256, 512, 1024]),
        configured=st.sampled_from([128, 256, 512, 1024]),
        held=st.dictionaries(
            st.sampled_from(["a", "b", "c"]), st.lists(st.integers(0, 31), min_size=1, max_size=4)
        ),
        readable=st.booleans(),
    ),
    quick=100,
    full=400,
    deadline=None,
)
def test_the_check_never_lets_a_changed_size_meet_held_memory(
    recorded: int | None, configured: int, held: dict[str, list[int]], readable: bool
) -> None:
    """Whatever the records hold: a start is allowed only if every container's units
    are read at the size they were given (when that size is known)."""
    per_card = {gpu_uuid(0): 4096 // configured}
    snapshot = snapshot_of(held) if readable else None
    try:
        check_unit_size(configured, recorded, snapshot, per_card)
    except UnitSizeChanged as exc:
        assert "\n" not in str(exc)
        refused = True
    else:
        refused = False
    changed = recorded is not None and recorded != configured
    if changed and (not readable or held):
        assert refused
    if not changed and recorded is not None:
        assert not refused
    if recorded is None and readable:
        past_end = any(n >= per_card[gpu_uuid(0)] for numbers in held.values() for n in numbers)
        assert refused == past_end
