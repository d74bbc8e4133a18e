"""The enforcement probe on a real GPU with HAMi-core's libvgpu.so.

Runs only with ``pytest -m gpu`` on a machine with an NVIDIA driver and a libvgpu.so
(``GPUSHARE_LIBVGPU=/path/to/libvgpu.so``, else /usr/local/vgpu/libvgpu.so); skipped
cleanly otherwise. It runs the probe as the daemon would set up a container asking for
4 units of 256 MiB and 30 core units, and expects every limit to hold.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.gpu import probe


def _libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


LIBVGPU = Path(os.environ.get("GPUSHARE_LIBVGPU", "/usr/local/vgpu/libvgpu.so"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _libcuda(), reason="no NVIDIA driver (libcuda.so.1) here"),
    pytest.mark.skipif(not LIBVGPU.is_file(), reason=f"no libvgpu.so at {LIBVGPU}"),
]


def _uuid() -> str:
    import pynvml

    pynvml.nvmlInit()
    try:
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    finally:
        pynvml.nvmlShutdown()


def test_the_probe_finds_every_limit_enforced(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.update(
        NVIDIA_VISIBLE_DEVICES=_uuid(),
        CUDA_VISIBLE_DEVICES="0",
        LD_PRELOAD=str(LIBVGPU),
        CUDA_DEVICE_MEMORY_LIMIT_0=f"{4 * 256}m",
        CUDA_DEVICE_SM_LIMIT="30",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "vgpu.cache"),
    )
    result = subprocess.run(
        [sys.executable, "-m", "gpushare.gpu.probe"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    print(result.stdout, result.stderr)
    checks = probe.parse_report(result.stdout)
    assert checks is not None, result.stderr
    assert result.returncode == 0, probe.verdict(checks)[1]
