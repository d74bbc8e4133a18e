"""The device nodes a MIG device needs in its container, read from the host.

With ``--mig-device-specs`` both doors that hand out MIG devices (the device plugin's
MIG resources, ``deviceplugin/migserve.py``, and DRA claims, ``dra/claimplan.py``) pass
them: the parent card's ``/dev/nvidia<minor>`` and the capability nodes
``/dev/nvidia-caps/nvidia-cap<N>`` of its GPU instance and compute instance, N read from
``/proc/driver/nvidia-caps/mig-minors`` (lines ``gpu<minor>/gi<id>/access <N>`` and
``gpu<minor>/gi<id>/ci<id>/access <N>``), and the control nodes the host has.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import structlog

from gpushare.base.kerneltables import named_numbers
from gpushare.gpu.gpus import Gpu, MigDevice

log = structlog.get_logger(__name__)

MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"
CAP_DEVICE_DIR = "/dev/nvidia-caps"
#: Control nodes a CUDA program opens besides its card, passed where the host has them.
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def parse_mig_minors(text: str) -> dict[str, int]:
    """``gpu0/gi2/access 21`` lines -> {"gpu0/gi2/access": 21}; other lines are skipped."""
    return named_numbers(text)


class MissingCapability(LookupError):
    """mig-minors holds no entry for a MIG device's GPU or compute instance."""


def device_specs(
    device: MigDevice,
    parent_minor: int,
    minors: Mapping[str, int],
    control_nodes: Iterable[str] = (),
) -> tuple[str, ...]:
    """The device nodes of one MIG device (host and container paths alike)."""
    gi_key = f"gpu{parent_minor}/gi{device.gpu_instance}/access"
    ci_key = f"gpu{parent_minor}/gi{device.gpu_instance}/ci{device.compute_instance}/access"
    missing = [key for key in (gi_key, ci_key) if key not in minors]
    if missing:
        raise MissingCapability(
            f"MIG device {device.uuid}: no {' or '.join(missing)} in {MIG_MINORS}"
        )
    return (
        f"/dev/nvidia{parent_minor}",
        f"{CAP_DEVICE_DIR}/nvidia-cap{minors[gi_key]}",
        f"{CAP_DEVICE_DIR}/nvidia-cap{minors[ci_key]}",
        *control_nodes,
    )


def read_mig_nodes(
    cards: Iterable[Gpu],
    devices: Iterable[MigDevice],
    minors_file: Path = Path(MIG_MINORS),
    dev: Path = Path("/dev"),
) -> dict[str, tuple[str, ...]]:
    """MIG UUID -> its device nodes, for each of ``devices`` (on ``cards``), read once at
    start (a MIG layout change needs a restart anyway). A MIG device whose capabilities
    are not listed is logged and gets no device nodes (the container runtime may still
    add them)."""
    try:
        minors = parse_mig_minors(minors_file.read_text())
    except OSError as exc:
        log.error("mig_minors_unreadable", path=str(minors_file), error=exc.strerror)
        minors = {}
    control = [p for p in CONTROL_NODES if (dev / Path(p).name).exists()]
    parents = {gpu.uuid: gpu for gpu in cards}
    specs = {}
    for device in devices:
        try:
            minor = parents[device.parent_uuid].minor
            specs[device.uuid] = device_specs(device, minor, minors, control)
        except MissingCapability as exc:
            log.error("mig_device_specs_missing", mig=device.uuid, error=str(exc))
    return specs
