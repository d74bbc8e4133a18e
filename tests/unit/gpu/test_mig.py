"""MIG without a GPU: the simulated node file, the strategies, labels, health mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import RTX_3090, gpu_uuid
from hypothesis import given
from hypothesis import strategies as st
from kit.mig_layouts import A100_UUID, mig_uuid, reference_a100, uniform_a100

from gpushare.gpu.gpus import Gpu, GpuError, GpuEvent, MigDevice, SimulatedBackend
from gpushare.gpu.health import HealthPolicy, expand
from gpushare.gpu.mig import MigPlanError, MigStrategy, labels, plan


def write(path: Path, gpus: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"gpus": gpus}))
    return path


def shared_card(i: int) -> dict[str, Any]:
    return {"uuid": gpu_uuid(i), **RTX_3090, "index": i}


# ------------------------------------------------------------------ simulated node file


def test_simulated_reference_layout_reads_as_mig_devices(tmp_path: Path) -> None:
    backend = SimulatedBackend(write(tmp_path / "n.yaml", [reference_a100(), shared_card(1)]))
    a100, rtx = backend.discover()
    assert a100.mig_enabled and not a100.mig_pending and not rtx.mig_enabled
    assert [(d.profile, d.gpu_instance, d.compute_instance) for d in a100.mig_devices] == [
        ("3g.20gb", 2, 0),
        ("2g.10gb", 3, 0),
        ("1g.5gb", 9, 0),
        ("1g.5gb", 10, 0),
    ]
    assert {d.parent_uuid for d in a100.mig_devices} == {A100_UUID}
    assert a100.mig_devices[0] == MigDevice(mig_uuid(0), A100_UUID, "3g.20gb", 20096, 2, 0, 0, 42)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mig": False}, "'instances' need 'mig: true'"),
        ({"instances": {"a": 1}}, "'instances' must be a list"),
        ({"instances": [{"uuid": "GPU-x", "profile": "1g.5gb", "memory_mib": 1, "gi": 1}]},
         "starting with MIG-"),
        ({"instances": [{"uuid": "MIG-x", "profile": "1g.5", "memory_mib": 1, "gi": 1}]},
         "not a MIG profile"),
        ({"instances": [{"uuid": "MIG-x", "profile": "1g.5gb", "memory_mib": 0, "gi": 1}]},
         "must be positive"),
        ({"instances": [{"uuid": "MIG-x", "profile": "1g.5gb", "memory_mib": 9, "gi": -1}]},
         "'gi' must be a non-negative integer"),
        ({"instances": [{"uuid": "MIG-x", "profile": "1g.5gb", "memory_mib": 9, "gi": 1},
                        {"uuid": "MIG-y", "profile": "1g.5gb", "memory_mib": 9, "gi": 1}]},
         "gi 1 / ci 0 appears twice"),
        ({"instances": [{"uuid": "MIG-x", "profile": "1g.5gb", "memory_mib": 9, "gi": 1},
                        {"uuid": "MIG-x", "profile": "1g.5gb", "memory_mib": 9, "gi": 2}]},
         "uuid MIG-x appears twice"),
        ({"instances": ["MIG-x"]}, "instances\\[0\\] must be a mapping"),
    ],
)
def test_simulated_mig_mistakes_name_the_entry(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    card = {**reference_a100(), **change}
    with pytest.raises(GpuError, match=message) as caught:
        SimulatedBackend(write(tmp_path / "n.yaml", [card]))
    assert "gpus[0]" in str(caught.value)


def test_simulated_mig_events(tmp_path: Path) -> None:
    """An instance's XID names its instance; a removed instance is gone, then back;
    a changed MIG mode or a new instance is a changed layout, reported once."""
    path = write(tmp_path / "n.yaml", [reference_a100(), shared_card(1)])
    backend = SimulatedBackend(path, poll_seconds=0.01)
    backend.discover()
    seen: list[GpuEvent] = []

    def step(gpus: list[dict[str, Any]]) -> list[GpuEvent]:
        write(path, gpus)
        seen.clear()
        backend._look(seen.append)
        return list(seen)

    card = reference_a100()
    card["instances"][1]["xid"] = 43
    assert step([card, shared_card(1)]) == [GpuEvent(A100_UUID, xid=43, gpu_instance=3,
                                                      compute_instance=0)]
    removed = reference_a100()
    del removed["instances"][3]
    assert step([removed, shared_card(1)]) == [GpuEvent(mig_uuid(3), gone=True)]
    assert step([reference_a100(), shared_card(1)]) == [GpuEvent(mig_uuid(3), gone=False)]
    grown = reference_a100()
    grown["instances"].append(
        {"uuid": mig_uuid(9), "profile": "1g.5gb", "memory_mib": 4864, "gi": 11, "sm": 14}
    )
    assert step([grown, shared_card(1)]) == [
        GpuEvent(A100_UUID, mig_changed=True),
        GpuEvent(mig_uuid(9), gone=False),
    ]
    assert GpuEvent(A100_UUID, mig_changed=True) not in step([grown, shared_card(1)])
    assert step([grown]) == [GpuEvent(gpu_uuid(1), gone=True)]
    assert step([grown, {**shared_card(1), "mig": True}]) == [
        GpuEvent(gpu_uuid(1), gone=False),
        GpuEvent(gpu_uuid(1), mig_changed=True),  # back after a reset, in MIG mode now
    ]
    pending = {**shared_card(1), "mig_pending": True}
    assert step([reference_a100(), pending]) == [
        GpuEvent(mig_uuid(9), gone=True),  # not served, so harmless; card 1 said so already
    ]
    fresh = SimulatedBackend(write(tmp_path / "f.yaml", [shared_card(1)]))
    fresh.discover()
    write(tmp_path / "f.yaml", [pending])
    seen.clear()
    fresh._look(seen.append)
    assert seen == [GpuEvent(gpu_uuid(1), mig_changed=True)]  # MIG mode pending


# ------------------------------------------------------------------ strategies


def gpus_of(tmp_path: Path, entries: list[dict[str, Any]]) -> list[Gpu]:
    return SimulatedBackend(write(tmp_path / "n.yaml", entries)).discover()


def test_mixed_serves_one_resource_per_profile(tmp_path: Path) -> None:
    gpus = gpus_of(tmp_path, [reference_a100(), shared_card(1)])
    result = plan(gpus, MigStrategy.MIXED)
    assert {name: len(devices) for name, devices in result.exclusive.items()} == {
        "mig-1g.5gb": 2,
        "mig-2g.10gb": 1,
        "mig-3g.20gb": 1,
    }
    assert [g.uuid for g in result.shared] == [gpu_uuid(1)]
    assert result.skipped == ()


def test_single_refuses_the_reference_layout_in_one_line(tmp_path: Path) -> None:
    gpus = gpus_of(tmp_path, [reference_a100()])
    with pytest.raises(MigPlanError) as caught:
        plan(gpus, MigStrategy.SINGLE)
    message = str(caught.value)
    assert "\n" not in message
    assert "1g.5gb x2, 2g.10gb x1, 3g.20gb x1" in message and "mixed" in message


def test_single_serves_uniform_mig_devices_as_gpu(tmp_path: Path) -> None:
    gpus = gpus_of(
        tmp_path,
        [uniform_a100(gpu_uuid(0), 0, 0), uniform_a100(gpu_uuid(1), 1, 10), shared_card(2)],
    )
    result = plan(gpus, MigStrategy.SINGLE)
    assert list(result.exclusive) == ["gpu"]
    assert len(result.exclusive["gpu"]) == 14
    assert [g.uuid for g in result.shared] == [gpu_uuid(2)]


def test_none_leaves_mig_cards_out_and_an_all_mig_node_says_so(tmp_path: Path) -> None:
    gpus = gpus_of(tmp_path, [reference_a100()])
    result = plan(gpus, MigStrategy.NONE)
    assert result.shared == () and result.exclusive == {}
    assert [s.gpu.uuid for s in result.skipped] == [A100_UUID]
    reason = result.not_served(gpus)
    assert "every GPU on this node (1) is in MIG mode" in reason and "mixed" in reason
    assert plan(gpus, MigStrategy.MIXED).not_served(gpus) == ""


@pytest.mark.parametrize("strategy", list(MigStrategy))
@pytest.mark.parametrize("enabled", [False, True])
def test_pending_mig_mode_is_never_served(
    tmp_path: Path, strategy: MigStrategy, enabled: bool
) -> None:
    card = uniform_a100(gpu_uuid(0), 0, 0) if enabled else shared_card(0)
    gpus = gpus_of(tmp_path, [{**card, "mig_pending": True}])
    result = plan(gpus, strategy)
    assert result.shared == () and result.mig_devices == []
    assert "pending" in result.skipped[0].reason
    assert ("disabled" if enabled else "enabled") in result.skipped[0].reason
    assert "changing to it" in result.not_served(gpus)


PROFILES = ["1g.5gb", "2g.10gb", "3g.20gb", "1g.10gb+me", "1c.2g.10gb", "7g.40gb"]


@st.composite
def layouts(draw: st.DrawFn) -> list[Gpu]:
    gpus = []
    serial = 0
    for index in range(draw(st.integers(0, 4))):
        uuid = gpu_uuid(index)
        enabled = draw(st.booleans())
        devices = []
        if enabled:
            for gi in range(draw(st.integers(0, 4))):
                serial += 1
                devices.append(
                    MigDevice(mig_uuid(serial), uuid, draw(st.sampled_from(PROFILES)), 4864, gi, 0)
                )
        gpus.append(
            Gpu(uuid, "x", 40536, index, index, mig_enabled=enabled,
                mig_pending=draw(st.booleans()), mig_devices=tuple(devices))
        )
    return gpus


@given(layouts(), st.sampled_from(list(MigStrategy)))
def test_every_card_and_mig_device_is_served_once_or_left_out_with_a_reason(
    gpus: list[Gpu], strategy: MigStrategy
) -> None:
    try:
        result = plan(gpus, strategy)
    except MigPlanError:
        assert strategy is MigStrategy.SINGLE
        profiles = {d.profile for g in gpus if g.mig_enabled and not g.mig_pending
                    for d in g.mig_devices}
        assert len(profiles) > 1
        return
    served = [d.uuid for d in result.mig_devices]
    assert len(served) == len(set(served))
    skipped = {s.gpu.uuid for s in result.skipped}
    for gpu in gpus:
        in_shared = gpu in result.shared
        if gpu.mig_pending:
            assert gpu.uuid in skipped and not in_shared
            assert not set(served) & {d.uuid for d in gpu.mig_devices}
        elif not gpu.mig_enabled:
            assert in_shared
        elif strategy is MigStrategy.NONE or not gpu.mig_devices:
            assert gpu.uuid in skipped and not in_shared
        else:
            assert {d.uuid for d in gpu.mig_devices} <= set(served)
    for name, devices in result.exclusive.items():
        if strategy is MigStrategy.MIXED:
            assert {d.profile.replace("+", ".") for d in devices} == {name.removeprefix("mig-")}
        else:
            assert name == "gpu" and len({d.profile for d in devices}) == 1
    assert bool(result.not_served(gpus)) == (bool(gpus) and not result.shared and not served)


def test_labels_in_gpu_feature_discovery_style(tmp_path: Path) -> None:
    gpus = gpus_of(tmp_path, [reference_a100(), shared_card(1)])
    assert labels(plan(gpus, MigStrategy.MIXED), "gpushare.io") == {
        "gpushare.io/mig.strategy": "mixed",
        "gpushare.io/mig-1g.5gb.count": "2",
        "gpushare.io/mig-1g.5gb.memory": "4864",
        "gpushare.io/mig-1g.5gb.multiprocessors": "14",
        "gpushare.io/mig-2g.10gb.count": "1",
        "gpushare.io/mig-2g.10gb.memory": "9984",
        "gpushare.io/mig-2g.10gb.multiprocessors": "28",
        "gpushare.io/mig-3g.20gb.count": "1",
        "gpushare.io/mig-3g.20gb.memory": "20096",
        "gpushare.io/mig-3g.20gb.multiprocessors": "42",
    }
    assert labels(plan(gpus, MigStrategy.NONE), "x.io") == {}
    assert labels(plan(gpus[1:], MigStrategy.SINGLE), "x.io") == {"x.io/mig.strategy": "single"}


# ------------------------------------------------------------------ health mapping


def reference_devices(tmp_path: Path) -> dict[str, tuple[MigDevice, ...]]:
    (a100,) = gpus_of(tmp_path, [reference_a100()])
    return {a100.uuid: a100.mig_devices}


def test_an_xid_naming_an_instance_reaches_only_that_mig_device(tmp_path: Path) -> None:
    mig_of = reference_devices(tmp_path)
    event = GpuEvent(A100_UUID, xid=94, gpu_instance=9, compute_instance=0)
    assert [e.uuid for e in expand(event, mig_of)] == [mig_uuid(2)]
    by_gi = GpuEvent(A100_UUID, xid=94, gpu_instance=3)
    assert [e.uuid for e in expand(by_gi, mig_of)] == [mig_uuid(1)]


def test_an_xid_naming_no_instance_or_an_unknown_one_reaches_the_whole_card(
    tmp_path: Path,
) -> None:
    mig_of = reference_devices(tmp_path)
    everything = [A100_UUID] + [mig_uuid(i) for i in range(4)]
    for event in (
        GpuEvent(A100_UUID, xid=79),
        GpuEvent(A100_UUID, xid=79, gpu_instance=5, compute_instance=0),
        GpuEvent(A100_UUID, gone=True),
        GpuEvent(A100_UUID, mig_changed=True),
    ):
        expanded = expand(event, mig_of)
        assert [e.uuid for e in expanded] == everything
        assert {(e.xid, e.gone, e.mig_changed) for e in expanded} == {
            (event.xid, event.gone, event.mig_changed)
        }
    lone = GpuEvent(mig_uuid(3), gone=True)
    assert expand(lone, mig_of) == [lone]
    other = GpuEvent(gpu_uuid(5), xid=79)
    assert expand(other, mig_of) == [other]


def test_policy_a_vanished_mig_device_is_unhealthy_until_back_and_a_changed_layout_for_good(
    tmp_path: Path,
) -> None:
    mig_of = reference_devices(tmp_path)
    keys = [A100_UUID] + [d.uuid for d in mig_of[A100_UUID]]
    policy = HealthPolicy(keys, frozenset({43}), recovery_seconds=10.0)
    gone = policy.on_event(GpuEvent(mig_uuid(3), gone=True), now=0.0)
    assert gone is not None and not gone.healthy
    back = policy.on_event(GpuEvent(mig_uuid(3), gone=False), now=1.0)
    assert back is not None and back.healthy
    verdicts = [policy.on_event(e, 2.0) for e in expand(GpuEvent(A100_UUID, mig_changed=True),
                                                         mig_of)]
    assert all(v is not None and not v.healthy and "restart" in v.reason for v in verdicts)
    assert policy.on_event(GpuEvent(A100_UUID, mig_changed=True), 3.0) is None  # said once
    policy.on_event(GpuEvent(A100_UUID, gone=True), 4.0)
    again = policy.on_event(GpuEvent(A100_UUID, gone=False), 5.0)
    assert again is not None and not again.healthy  # back, but still the old layout
    policy.on_event(GpuEvent(mig_uuid(0), xid=94), 6.0)
    assert policy.tick(1000.0) == [] and policy.next_deadline() is None


@pytest.mark.parametrize("strategy", list(MigStrategy))
def test_mig_sharing_slices_mixed_mig_devices_as_cards_without_cores(
    tmp_path: Path, strategy: MigStrategy
) -> None:
    from gpushare.share.devices import Inventory, Resource

    gpus = gpus_of(tmp_path, [reference_a100(), shared_card(1)])
    if strategy is MigStrategy.SINGLE:
        with pytest.raises(MigPlanError):
            plan(gpus, strategy, sharing=True)
        return
    result = plan(gpus, strategy, sharing=True)
    if strategy is MigStrategy.NONE:
        assert result.shared_mig == () and [g.uuid for g in result.shared_gpus()] == [gpu_uuid(1)]
        return
    assert result.exclusive == {} and result.mig_devices == []
    sliced = result.shared_gpus()
    assert [g.uuid for g in sliced] == [gpu_uuid(1)] + [mig_uuid(i) for i in range(4)]
    first = sliced[1]
    assert (first.parent_uuid, first.memory_mib, first.numa_node, first.name) == (
        A100_UUID, 20096, 0, "A100-SXM4-40GB MIG 3g.20gb"
    )
    inventory = Inventory(sliced, 256)
    assert inventory.cards[mig_uuid(0)].units(Resource.MEMORY) == 78
    assert inventory.cards[mig_uuid(0)].units(Resource.CORE) == 0
    assert inventory.cards[gpu_uuid(1)].units(Resource.CORE) == 100
    assert result.mig_of() == {A100_UUID: a100_devices(gpus)}
    assert result.not_served(gpus) == ""


def a100_devices(gpus: list[Gpu]) -> tuple[MigDevice, ...]:
    return next(g for g in gpus if g.uuid == A100_UUID).mig_devices
