"""On a real GPU, read-only: MIG mode, the GPU-instance profiles the card offers and the
MIG devices NVML lists, named as NVIDIA's tools name them. Nothing here changes a MIG
setting (no mode switch, no instance created or destroyed).

Marked ``gpu`` and skipped where NVML cannot be loaded. Run with ``pytest -m gpu -s``:
the tests print what they saw.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest
from conftest import nvml_loads

from gpushare.gpu.migprofile import GPU_INSTANCE_PROFILES, parse_profile, profile_of
from gpushare.gpu.nvml import NvmlBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not nvml_loads(), reason="no NVIDIA driver or GPU on this machine"),
]


def _nvml() -> Any:
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def test_mig_mode_and_offered_profiles_read_only() -> None:
    nvml = _nvml()
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            try:
                current, pending = nvml.nvmlDeviceGetMigMode(handle)
            except nvml.NVMLError as exc:
                print(f"GPU{index} {name}: no MIG ({exc})")
                continue
            total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
            names = []
            for i in GPU_INSTANCE_PROFILES:
                try:
                    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, i)
                except nvml.NVMLError:
                    continue  # not offered by this card (or MIG off)
                full_ci = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}[int(info.sliceCount)]
                profile = profile_of(i, full_ci, int(info.memorySizeMB), total)
                assert parse_profile(str(profile)) == profile
                names.append(f"{profile} (ID {info.id}, {info.memorySizeMB} MiB)")
            print(f"GPU{index} {name}: MIG current={current} pending={pending}; {names}")
            assert current in (0, 1) and pending in (0, 1)
    finally:
        nvml.nvmlShutdown()


def test_discovered_mig_devices_match_nvidia_smi() -> None:
    backend = NvmlBackend()
    try:
        gpus = backend.discover()
    finally:
        backend.close()
    devices = [d for g in gpus for d in g.mig_devices]
    seen = [(d.uuid, d.profile, d.gpu_instance, d.compute_instance) for d in devices]
    print(f"MIG devices: {seen}")
    if not devices:
        pytest.skip("no card here is in MIG mode with MIG devices")
    if shutil.which("nvidia-smi"):
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
        # "  MIG 2g.10gb     Device  0: (UUID: MIG-...)"
        pattern = r"MIG (\S+)\s+Device\s+\d+: \(UUID: (MIG-[^)]+)\)"
        smi = {uuid: profile for profile, uuid in re.findall(pattern, listing)}
        assert {d.uuid: d.profile for d in devices} == smi
