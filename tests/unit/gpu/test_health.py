"""GPU health: the pure policy, and XIDs injected through the simulated node file."""

from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import TESLA_P4, Node, cards, gpu_uuid

from gpushare.config import parse_xids
from gpushare.gpu.gpus import GpuEvent
from gpushare.gpu.health import HealthPolicy
from gpushare.gpu.nvml import NvmlBackend, handle_address

A, B = gpu_uuid(0), gpu_uuid(1)


def policy(ignored: str = "13,31,43,45,68,109", recovery: float = 10.0) -> HealthPolicy:
    return HealthPolicy([A, B], parse_xids(ignored), recovery)


# ------------------------------------------------------------------ the policy, pure


def test_policy_ignores_application_xids_and_unknown_cards() -> None:
    p = policy()
    for xid in (13, 31, 43, 45, 68, 109):
        assert p.on_event(GpuEvent(A, xid=xid), now=1.0) is None
    assert p.on_event(GpuEvent("GPU-not-ours", xid=79), now=1.0) is None
    assert p.on_event(GpuEvent(A, gone=False), now=1.0) is None  # back without being gone
    assert p.next_deadline() is None and p.tick(1e9) == []


def test_policy_all_ignores_every_xid_but_not_a_lost_card() -> None:
    p = policy("all")
    assert p.on_event(GpuEvent(A, xid=79), now=1.0) is None
    verdict = p.on_event(GpuEvent(A, gone=True), now=1.0)
    assert verdict is not None and not verdict.healthy


def test_policy_non_fatal_xid_recovers_after_quiet_time_and_repeats_extend_it() -> None:
    p = policy(recovery=10.0)
    verdict = p.on_event(GpuEvent(A, xid=94), now=100.0)
    assert verdict is not None and (verdict.uuid, verdict.healthy) == (A, False)
    assert "XID 94" in verdict.reason
    assert p.next_deadline() == 110.0
    p.on_event(GpuEvent(A, xid=94), now=105.0)  # again: the quiet time starts over
    assert p.tick(114.9) == []
    (recovered,) = p.tick(115.0)
    assert (recovered.uuid, recovered.healthy) == (A, True)
    assert p.next_deadline() is None


def test_policy_fatal_xids_stay_until_the_card_is_seen_again() -> None:
    for fatal in (79, 48):
        p = policy(recovery=1.0)
        verdict = p.on_event(GpuEvent(A, xid=fatal), now=0.0)
        assert verdict is not None and not verdict.healthy and "seen again" in verdict.reason
        assert p.tick(1e6) == [] and p.next_deadline() is None
        assert p.on_event(GpuEvent(A, gone=True), now=5.0) is not None
        assert p.on_event(GpuEvent(A, xid=31), now=6.0) is None  # ignored while gone
        back = p.on_event(GpuEvent(A, gone=False), now=7.0)
        assert back is not None and back.healthy


def test_policy_a_non_fatal_xid_does_not_lift_a_fatal_one() -> None:
    p = policy(recovery=1.0)
    p.on_event(GpuEvent(A, xid=79), now=0.0)
    verdict = p.on_event(GpuEvent(A, xid=94), now=1.0)
    assert verdict is not None and not verdict.healthy
    assert p.tick(100.0) == []


def test_policy_a_lost_card_stays_unhealthy_until_back() -> None:
    p = policy(recovery=1.0)
    p.on_event(GpuEvent(A, xid=94), now=0.0)
    gone = p.on_event(GpuEvent(A, gone=True), now=0.5)
    assert gone is not None and not gone.healthy and "no longer visible" in gone.reason
    assert p.tick(100.0) == []  # the non-fatal quiet time does not bring a lost card back
    back = p.on_event(GpuEvent(A, gone=False), now=101.0)
    assert back is not None and back.healthy


# ------------------------------------------------------------------ through the daemon


def health_of(node: Node, uuid: str) -> set[str]:
    """Health strings of the card's devices, both resources, as the kubelet sees them."""
    return {
        device.health
        for resource in (node.memory, node.core)
        for device_id, device in node.kubelet.devices(resource).items()
        if device_id.startswith(uuid + "::")
    }


def wait_health(node: Node, uuid: str, health: str, timeout: float) -> bool:
    return node.kubelet.wait_for(lambda _k: health_of(node, uuid) == {health}, timeout)


def write(node: Node, gpus: list[dict[str, Any]]) -> float:
    node.write_gpus(gpus)
    return time.monotonic()


def test_fatal_xid_makes_one_card_unhealthy_the_other_stays_usable(
    node: Node,
) -> None:
    gpus = cards(TESLA_P4, 2)
    node.start(gpus)
    gpus[0]["xid"] = 79
    write(node, gpus)
    assert wait_health(node, A, "Unhealthy", 30.0)
    assert health_of(node, B) == {"Healthy"}
    # every device of the bad card is still listed: the kubelet keeps its bookkeeping
    assert len(node.kubelet.devices(node.memory)) == 2 * 29
    assert len(node.kubelet.devices(node.core)) == 200
    admitted = node.kubelet.admit("p", "main", {node.memory: 10, node.core: 50})
    assert admitted.card() == B


def test_ignored_xids_change_nothing(node: Node) -> None:
    gpus = cards(TESLA_P4, 2)
    node.start(gpus)
    gpus[0]["xid"] = 13  # ignored by default; delivered before the marker below
    gpus[1]["xid"] = 94  # not ignored: the marker that both events were handled
    write(node, gpus)
    assert wait_health(node, B, "Unhealthy", 30.0)
    assert health_of(node, A) == {"Healthy"}


def test_ignored_xids_all_ignores_even_fatal_ones(node: Node) -> None:
    gpus = cards(TESLA_P4, 2)
    node.start(gpus, ignored_xids="all")
    gpus[0]["xid"] = 79
    write(node, gpus[:1])  # card B leaves: a lost card is not an XID, so it still counts
    assert wait_health(node, B, "Unhealthy", 30.0)
    assert health_of(node, A) == {"Healthy"}


def test_non_fatal_xid_recovers_after_the_quiet_time_but_79_does_not(node: Node) -> None:
    recovery = 0.4
    gpus = cards(TESLA_P4, 2)
    node.start(gpus, health_recovery_seconds=recovery)
    gpus[0]["xid"] = 79
    gpus[1]["xid"] = 94
    write(node, gpus)
    assert wait_health(node, B, "Unhealthy", 30.0)
    unhealthy_at = time.monotonic()
    assert health_of(node, A) == {"Unhealthy"}
    assert wait_health(node, B, "Healthy", 30.0)
    assert time.monotonic() - unhealthy_at >= recovery * 0.9
    assert health_of(node, A) == {"Unhealthy"}  # fatal: no recovery by quiet time


def test_a_removed_card_goes_unhealthy_and_comes_back_when_seen_again(node: Node) -> None:
    gpus = cards(TESLA_P4, 2)
    node.start(gpus)
    assert node.daemon is not None and node.daemon.core.health is not None
    gpus[0]["xid"] = 79
    write(node, gpus)
    assert wait_health(node, A, "Unhealthy", 30.0)
    gpus[1]["xid"] = 94  # marker: handled after card A's departure in the same read
    write(node, gpus[1:])  # card A falls off the bus
    assert wait_health(node, B, "Unhealthy", 30.0)
    assert health_of(node, A) == {"Unhealthy"}
    assert "no longer visible" in node.daemon.core.health.reason(A)
    assert len(node.kubelet.devices(node.memory)) == 2 * 29  # listed, not dropped
    del gpus[0]["xid"]
    write(node, gpus)  # seen again (after a reset): the fatal XID is forgotten
    assert wait_health(node, A, "Healthy", 30.0)


class FakeNvml:
    """NVML at the hardware edge for the event watch: one card whose events arrive
    with a fresh ctypes pointer (as NVML's do), then one from a device that can no
    longer be read (fallen off the bus)."""

    def __init__(self, pynvml: Any, stop: threading.Event) -> None:
        self.pynvml = pynvml
        self.stop = stop
        self.card = pynvml.struct_c_nvmlDevice_t()
        self.lost = pynvml.struct_c_nvmlDevice_t()
        self.events = [
            (self.lost, pynvml.nvmlEventTypeXidCriticalError, 79),
            (self.card, pynvml.nvmlEventTypeXidCriticalError, 79),
        ]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        nvml = self.pynvml
        for name, value in {
            "nvmlInit": lambda: None,
            "nvmlEventSetCreate": lambda: object(),
            "nvmlEventSetFree": lambda events: None,
            "nvmlDeviceRegisterEvents": lambda handle, wanted, events: None,
            "nvmlEventSetWait_v2": self.wait,
            "nvmlDeviceGetUUID": self.uuid,
            "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": lambda index: ctypes.pointer(self.card),
            "nvmlDeviceGetPciInfo": lambda handle: SimpleNamespace(busId=b"0000:00:1e.0"),
            "nvmlDeviceGetMigMode": lambda handle: (0, 0),
            "nvmlDeviceGetMinorNumber": lambda handle: 0,
            "nvmlDeviceGetName": lambda handle: b"Tesla P4",
            "nvmlDeviceGetMemoryInfo": lambda handle: SimpleNamespace(total=7611 << 20),
        }.items():
            monkeypatch.setattr(nvml, name, value)

    def wait(self, events: Any, timeout_ms: int) -> Any:
        if not self.events:
            self.stop.set()
            raise self.pynvml.NVMLError(self.pynvml.NVML_ERROR_TIMEOUT)
        device, kind, data = self.events.pop(0)
        return self.pynvml.c_nvmlEventData_t(ctypes.pointer(device), kind, data, 0, 0)

    def uuid(self, handle: Any) -> str:
        if handle_address(handle) == handle_address(ctypes.pointer(self.card)):
            return gpu_uuid(0)
        raise self.pynvml.NVMLError(self.pynvml.NVML_ERROR_GPU_IS_LOST)


def test_nvml_events_reach_their_card_and_an_unreadable_source_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pynvml = pytest.importorskip("pynvml")
    stop = threading.Event()
    fake = FakeNvml(pynvml, stop)
    fake.install(monkeypatch)
    backend = NvmlBackend()
    assert [gpu.uuid for gpu in backend.discover()] == [gpu_uuid(0)]
    delivered: list[GpuEvent] = []
    backend.watch(delivered.append, stop)  # returns once the fake has no events left
    assert delivered == [GpuEvent(gpu_uuid(0), xid=79)]
