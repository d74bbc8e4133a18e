"""On a real GPU: NVML discovery, registration and an Allocate answer for a real card.

Marked ``gpu`` and skipped where NVML cannot be loaded (CI never has a GPU). Run
them on a GPU machine with ``.venv/bin/pytest -m gpu``.
"""

from __future__ import annotations

import shutil
import subprocess
import threading

import pytest
from conftest import Node, nvml_loads

from gpushare.gpu.gpus import GpuEvent
from gpushare.gpu.nvml import NvmlBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not nvml_loads(), reason="no NVIDIA driver or GPU on this machine"),
]


def _smi_cards() -> dict[str, int]:
    """UUID -> total MiB as nvidia-smi reports it."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return {uuid.strip(): int(mib) for uuid, mib in (line.split(",") for line in out.splitlines())}


def test_nvml_discovery_reads_every_card() -> None:
    backend = NvmlBackend()
    try:
        gpus = backend.discover()
    finally:
        backend.close()
    assert gpus, "NVML loaded but listed no GPU"
    assert [g.index for g in gpus] == list(range(len(gpus)))
    for gpu in gpus:
        assert gpu.uuid.startswith(("GPU-", "MIG-")) and len(gpu.uuid) + 6 <= 63
        assert gpu.memory_mib > 1024 and gpu.name
    if shutil.which("nvidia-smi"):
        smi = _smi_cards()
        assert set(smi) == {g.uuid for g in gpus}
        for gpu in gpus:  # nvidia-smi rounds to MiB the same way
            assert abs(smi[gpu.uuid] - gpu.memory_mib) <= 1


def test_nvml_event_watch_runs_quietly_on_a_healthy_card() -> None:
    backend = NvmlBackend()
    backend.discover()
    events: list[GpuEvent] = []
    stop = threading.Event()
    watcher = threading.Thread(target=backend.watch, args=(events.append, stop), daemon=True)
    watcher.start()
    try:
        assert not stop.wait(2.0)
    finally:
        stop.set()
        watcher.join(timeout=5)
        backend.close()
    assert not watcher.is_alive(), "the NVML event loop did not stop within 5 s"
    assert events == []


def test_real_cards_register_and_allocate_one_card(node: Node) -> None:
    backend = NvmlBackend()
    try:
        gpus = [g for g in backend.discover() if not g.mig_enabled]
    finally:
        backend.close()
    if not gpus:
        pytest.skip("every GPU here is in MIG mode")
    node.start([], simulate="")
    unit = node.settings.memory_unit_mib
    memory = node.kubelet.devices(node.memory)
    per_card: dict[str, int] = {}
    for device_id in memory:
        uuid, _, n = device_id.partition("::")
        assert n.isdigit()
        per_card[uuid] = per_card.get(uuid, 0) + 1
    assert per_card == {g.uuid: g.memory_mib // unit for g in gpus}
    assert len(node.kubelet.devices(node.core)) == 100 * len(gpus)

    admitted = node.kubelet.admit("real", "main", {node.memory: 4, node.core: 50})
    assert admitted.conflicts == []
    assert admitted.card() in per_card
    assert admitted.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{4 * unit}m"
    assert admitted.envs["CUDA_DEVICE_SM_LIMIT"] == "50"
