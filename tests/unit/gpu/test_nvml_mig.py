"""The NVML backend against a fake NVML: MIG discovery, profile names, pending mode,
the NUMA fallback, MIG devices that vanish and MIG layouts that change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kit.fake_nvml import FakeCard, FakeMig, FakeNvml, reference_layout

from gpushare.gpu.gpus import GpuEvent
from gpushare.gpu.nvml import NvmlBackend


@pytest.fixture
def pynvml() -> Any:
    return pytest.importorskip("pynvml")


def backend_with(
    pynvml: Any, monkeypatch: pytest.MonkeyPatch, cards: list[FakeCard], sysfs: Path
) -> tuple[NvmlBackend, FakeNvml]:
    fake = FakeNvml(pynvml, cards)
    fake.install(monkeypatch)
    return NvmlBackend(sysfs=sysfs), fake


def test_reference_layout_is_discovered_with_nvidia_profile_names(
    pynvml: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    backend, _ = backend_with(
        pynvml, monkeypatch, [reference_layout(), FakeCard("GPU-plain", numa=1)], tmp_path
    )
    a100, plain = backend.discover()
    assert a100.mig_enabled and not a100.mig_pending and not plain.mig_enabled
    assert [(d.uuid, d.profile, d.gpu_instance, d.compute_instance, d.index, d.memory_mib)
            for d in a100.mig_devices] == [
        ("MIG-a", "3g.20gb", 2, 0, 0, 20096),
        ("MIG-b", "2g.10gb", 3, 0, 1, 9984),
        ("MIG-c", "1g.5gb", 9, 0, 2, 4864),
        ("MIG-d", "1g.5gb", 10, 0, 4, 4864),
    ]
    assert plain.mig_devices == ()
    assert [d.sm_count for d in a100.mig_devices] == [42, 28, 14, 14]


def test_profiles_come_from_slice_counts_where_instances_cannot_be_read(
    pynvml: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    card = reference_layout()
    card.hide_instances = True
    card.migs.append(
        FakeMig("MIG-e", gi=11, ci=0, gi_profile=1, ci_profile=0, memory_mib=9984, sm=14, index=5)
    )
    backend, _ = backend_with(pynvml, monkeypatch, [card], tmp_path)
    (a100,) = backend.discover()
    assert [d.profile for d in a100.mig_devices] == [
        "3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb", "1c.2g.10gb"
    ]


@pytest.mark.parametrize(("mode", "pending"), [((0, 1), True), ((1, 0), True), ((1, 1), False)])
def test_pending_mig_mode_is_read(
    pynvml: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: tuple[int, int],
    pending: bool,
) -> None:
    card = FakeCard("GPU-p", mig=mode)
    backend, _ = backend_with(pynvml, monkeypatch, [card], tmp_path)
    (gpu,) = backend.discover()
    assert gpu.mig_pending is pending and gpu.mig_enabled is bool(mode[0])


def test_numa_node_from_sysfs_else_from_nvml(
    pynvml: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "0000:07:00.0").mkdir()
    (tmp_path / "0000:07:00.0" / "numa_node").write_text("1\n")
    cards = [
        FakeCard("GPU-sysfs", bus_id="00000000:07:00.0", numa=0),  # sysfs wins
        FakeCard("GPU-nvml", bus_id="00000000:08:00.0", numa=3),  # not in sysfs
        FakeCard("GPU-none", bus_id="00000000:09:00.0", numa=None),  # neither knows
        FakeCard("GPU-neg", bus_id="00000000:0A:00.0", numa=-1),
    ]
    backend, _ = backend_with(pynvml, monkeypatch, cards, tmp_path)
    assert [g.numa_node for g in backend.discover()] == [1, 3, None, None]


def test_probe_sees_a_mig_device_vanish_and_return_and_a_layout_change_once(
    pynvml: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    card = reference_layout()
    backend, _fake = backend_with(pynvml, monkeypatch, [card, FakeCard("GPU-plain")], tmp_path)
    backend.discover()
    lost: set[str] = set()
    seen: list[GpuEvent] = []
    backend.events.probe(lost, seen.append)
    assert seen == []
    vanished = card.migs.pop(3)
    backend.events.probe(lost, seen.append)
    assert seen == [GpuEvent("MIG-d", gone=True)]
    card.migs.append(vanished)
    backend.events.probe(lost, seen.append)
    assert seen[1:] == [GpuEvent("MIG-d", gone=False)]
    card.migs.append(FakeMig("MIG-new", 11, 0, 0, 0, 4864, 14, index=3))
    backend.events.probe(lost, seen.append)
    backend.events.probe(lost, seen.append)
    assert seen[2:] == [GpuEvent(card.uuid, mig_changed=True)]  # once
    _fake.cards[1].mig = (0, 1)  # the plain card will be in MIG mode after a reset
    backend.events.probe(lost, seen.append)
    assert seen[3:] == [GpuEvent("GPU-plain", mig_changed=True)]


def test_nvml_xid_events_carry_the_instance_only_on_mig_cards(
    pynvml: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import threading
    from types import SimpleNamespace

    backend, _ = backend_with(
        pynvml, monkeypatch, [reference_layout(), FakeCard("GPU-plain")], tmp_path
    )
    backend.discover()
    stop = threading.Event()
    xid = pynvml.nvmlEventTypeXidCriticalError
    events = [
        SimpleNamespace(device=("card", 0), eventType=xid, eventData=94,
                        gpuInstanceId=9, computeInstanceId=0),
        SimpleNamespace(device=("card", 0), eventType=xid, eventData=79,
                        gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF),
        SimpleNamespace(device=("card", 1), eventType=xid, eventData=79,
                        gpuInstanceId=0, computeInstanceId=0),  # no MIG: ignored
    ]
    registered: list[tuple[Any, int]] = []

    def wait(_events: Any, _timeout_ms: int) -> Any:
        if not events:
            stop.set()
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return events.pop(0)

    for name, value in {
        "nvmlEventSetCreate": lambda: object(),
        "nvmlEventSetFree": lambda _events: None,
        "nvmlDeviceRegisterEvents": lambda h, kinds, _events: registered.append((h, kinds)),
        "nvmlEventSetWait_v2": wait,
    }.items():
        monkeypatch.setattr(pynvml, name, value)
    seen: list[GpuEvent] = []
    backend.watch(seen.append, stop)
    a100 = reference_layout().uuid
    assert seen == [
        GpuEvent(a100, xid=94, gpu_instance=9, compute_instance=0),
        GpuEvent(a100, xid=79),
        GpuEvent("GPU-plain", xid=79),
    ]
    assert (("card", 0), pynvml.nvmlEventMigConfigChange) in registered  # MIG card only
    assert (("card", 1), pynvml.nvmlEventMigConfigChange) not in registered
