"""The DRA resource model: what this node publishes and what a claim's result means. Pure.

One device per physical card (``gpu-<index>``) with ``allowMultipleAllocations: true``
and two consumable capacities:

* ``memory``: the card's memory rounded DOWN to the memory unit; a request that names
  no memory gets the whole (published) card (``requestPolicy.default``); requests are
  rounded UP to ``min + n * step`` with ``min = step = one unit``;
* ``cores``: 100; default 0 (a claim that names no cores is not throttled); step 1.

So the scheduler's own allocator checks both capacities of the same device, and the
rounded ``consumedCapacity`` it writes into the claim is what the container is held to,
to the MiB (:func:`share_of`), whatever the memory unit is now: a claim allocated under
another unit is held to what it was charged, never rounded up to the new unit. Cards in
MIG mode publish their MIG devices instead, each a whole device (``gpu-<index>-mig-<gi>-
<ci>``), never shared.

Consequences (tested in ``tests/test_dra_model.py``, documented in ``docs/dra.md``):
a claim with no sizes gets the whole card's memory and no core limit (the card to
itself); memory alone runs unthrottled; cores alone also takes all the memory.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from gpushare.base.quantity import MIB, QuantityError, mebibytes, parse_quantity
from gpushare.gpu.gpus import Gpu, MigDevice
from gpushare.gpu.health import HealthReader, unhealthy
from gpushare.kube.labels import arch_family

DEFAULT_DRIVER = "gpu.gpushare.io"
API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = 128
MEMORY = "memory"
CORES = "cores"
FULL_CORES = 100
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
UNHEALTHY_TAINT = "unhealthy"  # the key is <driver>/unhealthy


class ShareError(ValueError):
    """A claim's allocation that cannot be served as written; one readable line."""


# --------------------------------------------------------------------------- rounding


def round_up(request: Fraction, minimum: Fraction, step: Fraction) -> Fraction:
    """What the allocator charges for ``request`` under ``validRange{min, step}``:
    ``min`` if below it, else the next ``min + n * step``."""
    if request <= minimum:
        return minimum
    return minimum + math.ceil((request - minimum) / step) * step


def consume(capacity: Mapping[str, Any], requests: Mapping[str, Any]) -> dict[str, Fraction] | None:
    """The capacities one request would consume of a device with ``capacity`` (the
    published JSON), as the scheduler's allocator computes them; None when the device
    cannot serve it (a value above ``max`` or above the capacity). A model of the
    allocator's arithmetic for one device, used by the tests and the docs' examples."""
    consumed: dict[str, Fraction] = {}
    for name, entry in capacity.items():
        value = parse_quantity(entry["value"])
        policy = entry.get("requestPolicy") or {}
        asked = requests.get(name)
        if asked is None:
            amount = parse_quantity(policy["default"]) if "default" in policy else value
        else:
            amount = parse_quantity(asked)
        valid = policy.get("validRange")
        if valid:
            step = parse_quantity(valid["step"]) if "step" in valid else None
            minimum = parse_quantity(valid["min"])
            amount = round_up(amount, minimum, step) if step else max(amount, minimum)
            if "max" in valid and amount > parse_quantity(valid["max"]):
                return None
        if amount > value:
            return None
        consumed[name] = amount
    return consumed


@dataclass(frozen=True)
class Share:
    """A claim's part of one card, as the interposer is told: memory in MiB."""

    memory_mib: int
    cores: int  # 0: no core limit


def share_of(consumed: Mapping[str, Any] | None, card_memory_mib: int, unit_mib: int) -> Share:
    """The share a result's ``consumedCapacity`` grants on a card of ``card_memory_mib``.

    Memory is what the scheduler charged, rounded UP to a whole MiB (the interposer's
    grain) and never to the memory unit: the allocator already rounded the request to
    the unit the slice had *when it allocated*, and the unit may have changed since (a
    claim of 256 MiB allocated under 256 MiB units, prepared after a change to 1024,
    used to get 1024 MiB: four times its charge, the card over-committed). So the limits
    on a card never add up to more than the scheduler charged on it, give or take under
    a MiB per claim written by a policy that is not ours.
    No ``consumedCapacity`` at all (an API server or scheduler without consumable
    capacity) means the whole card: the published memory, no core limit.
    Raises :class:`ShareError` for a value the card cannot hold or that is not a quantity.
    """
    if not consumed:
        return Share(card_memory_mib // unit_mib * unit_mib, 0)
    key = (MEMORY in consumed, consumed.get(MEMORY), CORES in consumed, consumed.get(CORES))
    try:
        hash(key)
    except TypeError:  # not a quantity (the parse says so, in one line)
        return _share(*key, card_memory_mib, unit_mib)
    return _parsed_share(*key, card_memory_mib, unit_mib)


def _share(
    has_memory: bool,
    memory_value: Any,
    has_cores: bool,
    cores_value: Any,
    card_memory_mib: int,
    unit_mib: int,
) -> Share:
    """:func:`share_of` of the ``memory`` and ``cores`` entries (each: there?, value)."""
    published_mib = card_memory_mib // unit_mib * unit_mib
    try:
        memory = parse_quantity(memory_value) if has_memory else None
        cores = parse_quantity(cores_value) if has_cores else Fraction(0)
    except QuantityError as exc:
        raise ShareError(f"consumedCapacity: {exc}") from None
    mib = published_mib if memory is None else math.ceil(memory / MIB)
    if mib < 1 or mib > card_memory_mib:
        raise ShareError(
            f"consumedCapacity memory {memory_value} is not between 1Mi "
            f"and the card's {card_memory_mib}Mi"
        )
    whole_cores = math.ceil(cores)
    if not 0 <= whole_cores <= FULL_CORES:
        raise ShareError(f"consumedCapacity cores {cores_value} is not within 0..100")
    return Share(mib, whole_cores)


#: A prepare reads a result's share three times (its mates' limits, its own limits, its
#: grant) and the node's claims ask few distinct sizes: each is parsed once. Pure (a
#: value that fails is not kept: the error is raised again).
_parsed_share = functools.lru_cache(maxsize=512)(_share)


# --------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class Offered:
    """One device of this node's pool, and what it stands for."""

    name: str
    uuid: str  # the card's, or the MIG device's
    memory_mib: int  # as published (a card's rounded down to the unit)
    shared: bool  # a card with consumable capacity (else a whole MIG device)
    card_index: int
    card_memory_mib: int = 0  # the physical card's (shared devices)
    card_uuid: str = ""  # the physical card's (its health)
    attributes: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)


def health_keys(device: Offered) -> tuple[str, ...]:
    """The health board's keys ``device`` depends on: its card's UUID and, for a MIG
    device, its own (an XID naming its GPU instance, or the device lost, is its alone)."""
    return tuple(dict.fromkeys((device.card_uuid or device.uuid, device.uuid)))


def unhealthy_reason(board: HealthReader, device: Offered) -> str | None:
    """Why ``device`` is unhealthy (its card's reason first, then its own); None when it
    is healthy (:func:`gpushare.gpu.health.unhealthy` over its :func:`health_keys`)."""
    return unhealthy(board, health_keys(device))


def card_device_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.index}"


def mig_device_name(gpu: Gpu, mig: MigDevice) -> str:
    return f"gpu-{gpu.index}-mig-{mig.gpu_instance}-{mig.compute_instance}"


_NOT_LABEL = re.compile(r"[^A-Za-z0-9._-]")


def semver(text: str) -> str | None:
    """``550.54.15`` or ``550.54`` as a semantic version (``550.54.0``); None if neither."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    numbers = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(numbers)


#: The device attributes naming the backends that hold a device's limits.
MEMORY_ENFORCEMENT, COMPUTE_ENFORCEMENT = "memoryEnforcement", "computeEnforcement"


def _card_attributes(
    gpu: Gpu, driver_version: str | None, pcie_root: str | None
) -> dict[str, dict[str, Any]]:
    attributes: dict[str, dict[str, Any]] = {
        "type": {"string": "gpu"},
        "uuid": {"string": gpu.uuid},
        "productName": {"string": gpu.name[:64]},
        "index": {"int": gpu.index},
    }
    if gpu.compute_capability is not None:
        major, minor = gpu.compute_capability
        attributes["architecture"] = {"string": arch_family(major, minor)}
        attributes["computeCapability"] = {"version": f"{major}.{minor}.0"}
    version = semver(driver_version) if driver_version else None
    if version:
        attributes["driverVersion"] = {"version": version}
    if pcie_root:
        attributes[PCIE_ROOT] = {"string": pcie_root}
    return attributes


def offered_devices(
    gpus: Iterable[Gpu],
    unit_mib: int,
    *,
    driver_version: str | None = None,
    pcie_roots: Mapping[str, str] | None = None,
    enforcement: Mapping[str, tuple[str, str]] | None = None,
) -> list[Offered]:
    """This node's devices, in card-index order (the allocator tries them first-fit in
    slice order); a card in MIG mode stands for its MIG devices; a card smaller than
    one unit is left out. ``enforcement``: card UUID -> its (memory, compute) backends,
    published as ``memoryEnforcement`` and ``computeEnforcement`` (a claim's selector
    can require ``driver``); MIG devices are ``hardware``."""
    roots = pcie_roots or {}
    offered: list[Offered] = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        base = _card_attributes(gpu, driver_version, roots.get(gpu.uuid))
        if enforcement is not None:
            memory, compute = (
                ("hardware", "hardware") if gpu.mig_enabled else enforcement.get(gpu.uuid, ("", ""))
            )
            if memory:
                base[MEMORY_ENFORCEMENT] = {"string": memory}
                base[COMPUTE_ENFORCEMENT] = {"string": compute}
        if gpu.mig_enabled:
            for mig in sorted(gpu.mig_devices, key=lambda m: (m.gpu_instance, m.compute_instance)):
                attributes = {
                    **{k: v for k, v in base.items() if k != "uuid"},
                    "type": {"string": "mig"},
                    "uuid": {"string": mig.uuid},
                    "parentUUID": {"string": gpu.uuid},
                    "profile": {"string": _NOT_LABEL.sub("_", mig.profile)[:64]},
                }
                offered.append(
                    Offered(
                        mig_device_name(gpu, mig),
                        mig.uuid,
                        mig.memory_mib,
                        shared=False,
                        card_index=gpu.index,
                        card_uuid=gpu.uuid,
                        attributes=attributes,
                    )
                )
            continue
        units = gpu.memory_mib // unit_mib
        if units < 1:
            continue
        offered.append(
            Offered(
                card_device_name(gpu),
                gpu.uuid,
                units * unit_mib,
                shared=True,
                card_index=gpu.index,
                card_memory_mib=gpu.memory_mib,
                card_uuid=gpu.uuid,
                attributes=base,
            )
        )
    return offered


def capacity_json(device: Offered, unit_mib: int) -> dict[str, Any]:
    """The ``capacity`` map of one device (with request policies for shared ones)."""
    memory = mebibytes(device.memory_mib)
    if not device.shared:
        return {MEMORY: {"value": memory}}
    unit = mebibytes(unit_mib)
    return {
        MEMORY: {
            "value": memory,
            "requestPolicy": {"default": memory, "validRange": {"min": unit, "step": unit}},
        },
        CORES: {
            "value": str(FULL_CORES),
            "requestPolicy": {
                "default": "0",
                "validRange": {"min": "0", "max": str(FULL_CORES), "step": "1"},
            },
        },
    }


def device_json(
    device: Offered, unit_mib: int, driver: str, *, unhealthy: str | None = None
) -> dict[str, Any]:
    """One ``spec.devices[]`` entry; ``unhealthy`` (the reason) adds a NoSchedule taint."""
    entry: dict[str, Any] = {
        "name": device.name,
        "attributes": dict(device.attributes),
        "capacity": capacity_json(device, unit_mib),
    }
    if device.shared:
        entry["allowMultipleAllocations"] = True
    if unhealthy is not None:
        entry["taints"] = [
            {
                "key": f"{driver}/{UNHEALTHY_TAINT}",
                "value": _NOT_LABEL.sub("-", unhealthy)[:63].strip("-_.") or "unhealthy",
                "effect": "NoSchedule",
            }
        ]
    return entry


def slice_name(node: str, driver: str, number: int) -> str:
    return f"{node}-{driver}-{number}"[:253]


def slices_json(
    node: str,
    driver: str,
    generation: int,
    devices: Sequence[dict[str, Any]],
    owner: Mapping[str, Any] | None,
) -> list[dict[str, Any]]:
    """The pool ``node`` as ResourceSlices of at most 128 devices each (one slice,
    maybe empty, when there is nothing), every one carrying the pool's generation
    and the slice count."""
    chunks = [
        list(devices[i : i + MAX_DEVICES_PER_SLICE])
        for i in range(0, len(devices), MAX_DEVICES_PER_SLICE)
    ] or [[]]
    result = []
    for number, chunk in enumerate(chunks):
        metadata: dict[str, Any] = {"name": slice_name(node, driver, number)}
        if owner:
            metadata["ownerReferences"] = [dict(owner)]
        result.append(
            {
                "apiVersion": API_VERSION,
                "kind": "ResourceSlice",
                "metadata": metadata,
                "spec": {
                    "driver": driver,
                    "nodeName": node,
                    "pool": {
                        "name": node,
                        "generation": generation,
                        "resourceSliceCount": len(chunks),
                    },
                    "devices": chunk,
                },
            }
        )
    return result


def lost_in_storage(
    written: Sequence[dict[str, Any]], stored: Sequence[dict[str, Any]]
) -> list[str]:
    """What the API server dropped of shared devices (consumable capacity off): one
    text per device naming the missing fields; empty when everything was kept."""
    by_name = {d.get("name"): d for d in stored}
    problems = []
    for device in written:
        if not device.get("allowMultipleAllocations"):
            continue
        kept = by_name.get(device["name"]) or {}
        missing = []
        if kept.get("allowMultipleAllocations") is not True:
            missing.append("allowMultipleAllocations")
        for name, entry in device.get("capacity", {}).items():
            if "requestPolicy" in entry and not (kept.get("capacity") or {}).get(name, {}).get(
                "requestPolicy"
            ):
                missing.append(f"capacity.{name}.requestPolicy")
        if missing:
            problems.append(f"{device['name']}: {', '.join(missing)}")
    return problems


def taints_lost(written: Sequence[dict[str, Any]], stored: Sequence[dict[str, Any]]) -> bool:
    """True when a taint we wrote is not in what was stored (device taints off)."""
    by_name = {d.get("name"): d for d in stored}
    return any(
        device.get("taints") and not (by_name.get(device["name"]) or {}).get("taints")
        for device in written
    )
