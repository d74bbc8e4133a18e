"""MIG devices served as exclusive resources (see :mod:`gpushare.deviceplugin.exclusive`).

Pure: a :class:`~gpushare.gpu.mig.MigPlan` becomes one :class:`ExclusiveResource` per
resource name, each device ID a ``MIG-...`` UUID; an Allocate answer names the MIG
devices (``NVIDIA_VISIBLE_DEVICES=MIG-...`` and/or the CDI name) and, with
``--mig-device-specs``, passes the device nodes a MIG device needs (read from the host by
:mod:`gpushare.host.mignodes`, which the DRA door reads them with too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from gpushare.deviceplugin.exclusive import EditsFor, granted
from gpushare.gpu.gpus import Gpu, MigDevice
from gpushare.gpu.mig import MigPlan
from gpushare.host.mignodes import MIG_MINORS as MIG_MINORS
from gpushare.host.mignodes import MissingCapability as MissingCapability
from gpushare.host.mignodes import device_specs as device_specs
from gpushare.host.mignodes import parse_mig_minors as parse_mig_minors
from gpushare.host.mignodes import read_mig_nodes
from gpushare.share import answers
from gpushare.share.answers import ContainerEdits, DeviceListing
from gpushare.share.whole import ExclusiveDevice, ExclusiveResource

log = structlog.get_logger(__name__)



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


def read_device_specs(
    plan: MigPlan, minors_file: Path = Path(MIG_MINORS), dev: Path = Path("/dev")
) -> dict[str, tuple[str, ...]]:
    """MIG UUID -> its device nodes, of every MIG device the plan serves
    (:func:`gpushare.host.mignodes.read_mig_nodes`)."""
    return read_mig_nodes(plan.mig_cards, plan.mig_devices, minors_file, dev)


def socket_name(resource: ExclusiveResource) -> str:
    """``gpushare-mig-3g.20gb.sock``; single's ``gpu`` as ``gpushare-mig-gpu.sock``, apart
    from the whole cards' socket."""
    name = resource.name if resource.name.startswith("mig-") else f"mig-{resource.name}"
    return f"gpushare-{name}.sock"


def mig_answer(
    listing: DeviceListing,
    *,
    specs: Mapping[str, Sequence[str]] | None = None,
) -> EditsFor:
    """The Allocate answer of a MIG resource: the MIG devices named as ``listing`` says,
    with their device nodes when ``specs`` (MIG UUID -> node paths) is given. No
    interposer: a MIG device is a hardware partition (see docs/modes.md, MIG)."""

    def answer(devices: Sequence[ExclusiveDevice]) -> ContainerEdits:
        nodes = specs or {}
        grant = answers.whole([granted(d, nodes.get(d.id, ())) for d in devices])
        return answers.container_edits(grant, listing)

    return answer
