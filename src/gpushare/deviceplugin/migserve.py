"""MIG devices served as exclusive resources (see :mod:`gpushare.deviceplugin.exclusive`).

Pure: a :class:`~gpushare.gpu.mig.MigPlan` becomes one :class:`ExclusiveResource` per
resource name, each device ID a ``MIG-...`` UUID; an Allocate answer names the MIG
devices (``NVIDIA_VISIBLE_DEVICES=MIG-...`` and/or the CDI name) and, with
``--mig-device-specs``, passes the device nodes a MIG device needs: the parent card's
``/dev/nvidia<minor>`` and the capability nodes ``/dev/nvidia-caps/nvidia-cap<N>`` of
its GPU instance and compute instance, N read from ``/proc/driver/nvidia-caps/mig-minors``
(lines ``gpu<minor>/gi<id>/access <N>`` and ``gpu<minor>/gi<id>/ci<id>/access <N>``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import structlog

from gpushare.deviceplugin.exclusive import AnswerFor, granted
from gpushare.gpu.gpus import Gpu, MigDevice
from gpushare.gpu.mig import MigPlan
from gpushare.share import answers
from gpushare.share.answers import Answer, DeviceListing
from gpushare.share.whole import ExclusiveDevice, ExclusiveResource

log = structlog.get_logger(__name__)

MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"
CAP_DEVICE_DIR = "/dev/nvidia-caps"
#: Control nodes a CUDA program opens besides its card, passed where the host has them.
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def resources(plan: MigPlan, prefix: str) -> list[tuple[str, ExclusiveResource]]:
    """(full resource name, resource) for every resource of the plan."""
    cards = {gpu.uuid: gpu for gpu in plan.mig_cards}
    result = []
    for name, devices in plan.exclusive.items():
        resource = ExclusiveResource(name, (exclusive_device(cards, d) for d in devices))
        result.append((resource.name_with(prefix), resource))
    return result


def exclusive_device(cards: Mapping[str, Gpu], device: MigDevice) -> ExclusiveDevice:
    parent = cards[device.parent_uuid]
    return ExclusiveDevice(
        id=device.uuid,
        parent=parent.uuid,
        name=device.profile,
        index=parent.index * 100 + device.index,  # the node's order: card, then MIG index
        numa_node=parent.numa_node,
        memory_mib=device.memory_mib,
        cdi_id=f"{parent.index}:{device.index}",  # NVIDIA's CDI index name of a MIG device
    )


# --------------------------------------------------------------------------- device nodes


def parse_mig_minors(text: str) -> dict[str, int]:
    """``gpu0/gi2/access 21`` lines -> {"gpu0/gi2/access": 21}; other lines are skipped."""
    minors = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            minors[parts[0]] = int(parts[1])
    return minors


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


def read_device_specs(
    plan: MigPlan, minors_file: Path = Path(MIG_MINORS), dev: Path = Path("/dev")
) -> dict[str, tuple[str, ...]]:
    """MIG UUID -> its device nodes, read once at start (a MIG layout change needs a
    restart anyway). A MIG device whose capabilities are not listed is logged and gets
    no device nodes (the container runtime may still add them)."""
    try:
        minors = parse_mig_minors(minors_file.read_text())
    except OSError as exc:
        log.error("mig_minors_unreadable", path=str(minors_file), error=exc.strerror)
        minors = {}
    control = [p for p in CONTROL_NODES if (dev / Path(p).name).exists()]
    cards = {gpu.uuid: gpu for gpu in plan.mig_cards}
    specs = {}
    for device in plan.mig_devices:
        try:
            minor = cards[device.parent_uuid].minor
            specs[device.uuid] = device_specs(device, minor, minors, control)
        except MissingCapability as exc:
            log.error("mig_device_specs_missing", mig=device.uuid, error=str(exc))
    return specs


def socket_name(resource: ExclusiveResource) -> str:
    """``gpushare-mig-3g.20gb.sock``; single's ``gpu`` as ``gpushare-mig-gpu.sock``, apart
    from the whole cards' socket."""
    name = resource.name if resource.name.startswith("mig-") else f"mig-{resource.name}"
    return f"gpushare-{name}.sock"


def mig_answer(
    listing: DeviceListing,
    *,
    specs: Mapping[str, Sequence[str]] | None = None,
) -> AnswerFor:
    """The Allocate answer of a MIG resource: the MIG devices named as ``listing`` says,
    with their device nodes when ``specs`` (MIG UUID -> node paths) is given. No
    interposer: a MIG device is a hardware partition (see docs/modes.md, MIG)."""

    def answer(devices: Sequence[ExclusiveDevice]) -> Answer:
        nodes = specs or {}
        grant = answers.whole([granted(d, nodes.get(d.id, ())) for d in devices])
        return answers.container_edits(grant, listing)

    return answer
