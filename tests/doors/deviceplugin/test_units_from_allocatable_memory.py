"""Units are counted from what tenants can really allocate (issue 41 item 9).

NVML's total includes what the driver keeps for itself (about 450 MiB on a T4; the
``reserved`` of ``nvmlDeviceGetMemoryInfo`` version 2): sold to the last unit of the
nominal total, a card's last tenant fails below its grant. The daemon counts shares from
the total less the reservation, on the device plugin's lists and DRA's capacities alike;
a simulated node states it with ``reserved_mib`` (0 where unstated, so every other test's
counts are as before); the real backend reads it from NVML version 2, and takes 0 (the
nominal total, as before) where the driver has only version 1, saying so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from conftest import Node, gpu_uuid
from kit.fake_nvml import FakeCard, FakeNvml

from gpushare.dra.model import offered_devices
from gpushare.gpu.gpus import Gpu, GpuError
from gpushare.gpu.nvml import NvmlBackend
from gpushare.gpu.simulated import SimulatedBackend

TESLA_T4 = {"name": "Tesla T4", "memory_mib": 15360}  # NVML's total of a T4


def test_a_t4s_reserved_memory_is_not_advertised(node: Node) -> None:
    node.start([{"uuid": gpu_uuid(0), **TESLA_T4, "reserved_mib": 450},
                {"uuid": gpu_uuid(1), **TESLA_T4}])  # fmt: skip
    memory = node.kubelet.devices(node.memory)
    per_card = {u: sum(1 for d in memory if d.startswith(u + "::")) for u in map(gpu_uuid, (0, 1))}
    assert per_card == {gpu_uuid(0): 58, gpu_uuid(1): 60}  # (15360 - 450) // 256, 15360 // 256
    assert len(node.kubelet.devices(node.core)) == 200  # cores are not memory


def test_dra_capacity_is_counted_from_the_allocatable_memory() -> None:
    t4 = Gpu(gpu_uuid(0), "Tesla T4", 15360, 0, 0, reserved_mib=450)
    (device,) = offered_devices([t4], 256)
    assert device.memory_mib == 58 * 256
    assert device.card_memory_mib == 15360  # the card's own size, as before


def test_a_simulated_node_states_reserved_memory(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    gpus: list[dict[str, Any]] = [{"uuid": "GPU-a", "memory_mib": 1024, "reserved_mib": 100}]
    path.write_text(yaml.safe_dump({"gpus": gpus}))
    (gpu,) = SimulatedBackend(path).discover()
    assert (gpu.reserved_mib, gpu.allocatable_mib) == (100, 924)
    for bad in (-1, 1024, "450", True):
        path.write_text(yaml.safe_dump({"gpus": [{**gpus[0], "reserved_mib": bad}]}))
        with pytest.raises(GpuError, match="reserved_mib"):
            SimulatedBackend(path)


@pytest.mark.parametrize("reserved, expected", [(453, 453), (None, 0)])
def test_nvml_reads_the_reservation_from_version_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, reserved: int | None, expected: int
) -> None:
    pynvml = pytest.importorskip("pynvml")
    FakeNvml(pynvml, [FakeCard("GPU-t4", total_mib=15360, reserved_mib=reserved)]).install(
        monkeypatch
    )
    with structlog.testing.capture_logs() as logs:
        (gpu,) = NvmlBackend(sysfs=tmp_path).discover()
    assert (gpu.memory_mib, gpu.reserved_mib) == (15360, expected)
    unknown = [e for e in logs if e["event"] == "memory_reserved_unknown"]
    assert len(unknown) == (1 if reserved is None else 0)
