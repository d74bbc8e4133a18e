"""The DRA resource model: what is published, how requests round, what is enforced.

The allocator's arithmetic (:func:`consume`) is applied to the capacity JSON the node
publishes, so these properties follow a request from the claim to the container's
environment: published policy -> consumedCapacity -> share -> the same answer the
device plugin builds.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.base.quantity import MIB, QuantityError, parse_quantity
from gpushare.dra.model import (
    MAX_DEVICES_PER_SLICE,
    ShareError,
    capacity_json,
    consume,
    device_json,
    lost_in_storage,
    offered_devices,
    round_up,
    share_of,
    slices_json,
)
from gpushare.gpu.gpus import Gpu, MigDevice
from gpushare.share.answers import Enforcement, container_edits, share

ENFORCING = Enforcement(
    library=Path("/var/lib/gpushare/libvgpu.so.abc"), preload_file=None, use_ld_preload_env=True
)


def card(index: int = 0, memory_mib: int = 24259, **extra: object) -> Gpu:
    return Gpu(
        uuid=f"GPU-{index:04d}",
        name="NVIDIA GeForce RTX 3090",
        memory_mib=memory_mib,
        index=index,
        minor=index,
        compute_capability=(8, 6),
        **extra,  # type: ignore[arg-type]
    )


def published(gpu: Gpu, unit: int) -> dict[str, object]:
    (device,) = offered_devices([gpu], unit)
    return capacity_json(device, unit)


def limits(consumed: dict[str, Fraction], gpu: Gpu, unit: int) -> dict[str, str]:
    text = {
        k: f"{v.numerator}" if v.denominator == 1 else f"{float(v)}" for k, v in consumed.items()
    }
    granted = share_of(text, gpu.memory_mib, unit)
    grant = share(
        gpu.uuid,
        enforcement=ENFORCING,
        memory_mib=granted.memory_mib,
        cores=granted.cores or None,
    )
    return container_edits(grant).envs


def test_quantities() -> None:
    assert parse_quantity("4Gi") == 4 << 30
    assert parse_quantity("500m") == Fraction(1, 2)
    assert parse_quantity("1e3") == 1000
    assert parse_quantity("1.5Mi") == 3 << 19
    assert parse_quantity(30) == 30
    for bad in ("", "4GB", "Gi", "1e999", True, None, "1" * 80):
        with pytest.raises(QuantityError):
            parse_quantity(bad)


@settings(max_examples=300, deadline=None)
@given(
    unit=st.sampled_from([1, 64, 256, 1024]),
    memory_mib=st.integers(1024, 200_000),
    asked_bytes=st.integers(1, 200_000 * MIB),
    asked_cores=st.one_of(st.none(), st.integers(0, 100), st.sampled_from(["500m", "30.5"])),
)
def test_requests_round_up_and_the_rounded_value_is_enforced(
    unit: int, memory_mib: int, asked_bytes: int, asked_cores: object
) -> None:
    gpu = card(memory_mib=memory_mib)
    capacity = published(gpu, unit)
    requests: dict[str, object] = {"memory": str(asked_bytes)}
    if asked_cores is not None:
        requests["cores"] = asked_cores
    consumed = consume(capacity, requests)
    card_bytes = (memory_mib // unit) * unit * MIB
    if asked_bytes > card_bytes:
        assert consumed is None  # no such card: the allocator skips the device
        return
    assert consumed is not None
    step = unit * MIB
    # rounded up, to a whole unit, by less than one unit
    assert consumed["memory"] >= asked_bytes
    assert consumed["memory"] % step == 0
    assert consumed["memory"] - asked_bytes < step
    envs = limits(consumed, gpu, unit)
    assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{int(consumed['memory']) // MIB}m"
    if asked_cores is None or parse_quantity(asked_cores) == 0:
        assert "CUDA_DEVICE_SM_LIMIT" not in envs
    else:
        cores = math.ceil(parse_quantity(asked_cores))
        assert consumed["cores"] == cores
        assert envs["CUDA_DEVICE_SM_LIMIT"] == str(cores)


@given(
    request=st.fractions(min_value=0, max_value=10_000),
    minimum=st.fractions(min_value=0, max_value=100),
    step=st.fractions(min_value=Fraction(1, 8), max_value=100),
)
def test_round_up_is_the_least_valid_value_at_or_above(
    request: Fraction, minimum: Fraction, step: Fraction
) -> None:
    rounded = round_up(request, minimum, step)
    assert rounded >= request and rounded >= minimum
    assert ((rounded - minimum) / step).denominator == 1
    assert rounded == minimum or rounded - step < request


def test_no_sizes_gets_the_whole_card_unthrottled() -> None:
    gpu = card(memory_mib=24259)
    consumed = consume(published(gpu, 256), {})
    assert consumed == {"memory": 94 * 256 * MIB, "cores": 0}  # rounded down to the unit
    envs = limits(consumed, gpu, 256)
    assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{94 * 256}m"
    assert "CUDA_DEVICE_SM_LIMIT" not in envs


def test_memory_alone_is_unthrottled() -> None:
    gpu = card()
    consumed = consume(published(gpu, 256), {"memory": "4Gi"})
    assert consumed == {"memory": 4 << 30, "cores": 0}
    assert "CUDA_DEVICE_SM_LIMIT" not in limits(consumed, gpu, 256)


def test_cores_alone_takes_all_the_memory() -> None:
    gpu = card()
    consumed = consume(published(gpu, 256), {"cores": "30"})
    assert consumed == {"memory": 94 * 256 * MIB, "cores": 30}
    # so a second claim of any size no longer fits on this card
    assert consumed["memory"] + 256 * MIB > parse_quantity(published(gpu, 256)["memory"]["value"])  # type: ignore[index]


def test_cores_above_100_do_not_fit() -> None:
    assert consume(published(card(), 256), {"cores": "101"}) is None


def test_share_of_refuses_what_no_card_holds() -> None:
    with pytest.raises(ShareError):
        share_of({"memory": "100Gi"}, 24259, 256)
    with pytest.raises(ShareError):
        share_of({"memory": "4Gi", "cores": "150"}, 24259, 256)
    with pytest.raises(ShareError):
        share_of({"memory": "lots"}, 24259, 256)
    # a result written under another policy (or unit) is what it was charged, to the MiB
    assert share_of({"memory": "1Mi"}, 24259, 256).memory_mib == 1
    assert share_of({"memory": "1.5Mi"}, 24259, 256).memory_mib == 2
    assert share_of({"memory": "256Mi"}, 24259, 1024).memory_mib == 256
    assert share_of(None, 24259, 256) == share_of({}, 24259, 256)


def test_devices_attributes_and_mig() -> None:
    mig = MigDevice("MIG-a", "GPU-0001", "3g.20gb", 19968, gpu_instance=1, compute_instance=0)
    gpus = [card(1, mig_enabled=True, mig_devices=(mig,)), card(0), card(2, memory_mib=100)]
    offered = offered_devices(
        gpus, 256, driver_version="550.54", pcie_roots={"GPU-0000": "pci0000:3a"}
    )
    assert [d.name for d in offered] == ["gpu-0", "gpu-1-mig-1-0"]  # the 100 MiB card: no unit
    shared, whole = (device_json(d, 256, "gpu.gpushare.io") for d in offered)
    assert shared["allowMultipleAllocations"] is True
    assert shared["attributes"]["driverVersion"] == {"version": "550.54.0"}
    assert shared["attributes"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:3a"}
    assert shared["attributes"]["architecture"] == {"string": "ampere"}
    assert "allowMultipleAllocations" not in whole
    assert whole["capacity"] == {"memory": {"value": "19968Mi"}}
    assert whole["attributes"]["parentUUID"] == {"string": "GPU-0001"}


def test_slices_hold_at_most_128_devices_each() -> None:
    gpus = [card(i) for i in range(300)]
    devices = [device_json(d, 1024, "d.example") for d in offered_devices(gpus, 1024)]
    owner = {"apiVersion": "v1", "kind": "Node", "name": "n", "uid": "u", "controller": True}
    slices = slices_json("n", "d.example", 7, devices, owner)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 44]
    assert all(len(s["spec"]["devices"]) <= MAX_DEVICES_PER_SLICE for s in slices)
    assert {s["spec"]["pool"]["generation"] for s in slices} == {7}
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {3}
    assert len({s["metadata"]["name"] for s in slices}) == 3
    assert slices_json("n", "d.example", 1, [], None)[0]["spec"]["devices"] == []


def test_lost_in_storage_names_what_was_dropped() -> None:
    (device,) = [device_json(d, 256, "d") for d in offered_devices([card()], 256)]
    assert lost_in_storage([device], [device]) == []
    dropped = {k: v for k, v in device.items() if k != "allowMultipleAllocations"}
    dropped["capacity"] = {k: {"value": v["value"]} for k, v in device["capacity"].items()}
    (problem,) = lost_in_storage([device], [dropped])
    assert "allowMultipleAllocations" in problem and "capacity.memory.requestPolicy" in problem
