"""Hostile input over gRPC: the daemon answers a status or a valid one-card answer,
keeps serving, and never answers with a card it did not check. Plus a soak."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import pytest
from conftest import TESLA_P4, Node, cards, gpu_uuid
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit.procs import poll

from gpushare._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushare.share.devices import InvalidDeviceIds, Resource, parse_device_id, parse_unit_number
from gpushare.sim.kubeletdouble import Admitted

UNITS = {Resource.MEMORY: 29, Resource.CORE: 100}  # Tesla P4: 7611 // 256
HEALTHY = (gpu_uuid(0), gpu_uuid(1))
SICK = gpu_uuid(2)  # advertised, but unhealthy after an XID 79
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


@dataclass
class Plugin:
    node: Node
    stubs: dict[Resource, api_pb2_grpc.DevicePluginStub]


@pytest.fixture
def plugin(node: Node) -> Iterator[Plugin]:
    gpus = cards(TESLA_P4, 3)
    node.start(gpus)
    gpus[2]["xid"] = 79
    node.write_gpus(gpus)
    assert node.kubelet.wait_for(
        lambda k: k.healthy_count(node.memory) == 2 * UNITS[Resource.MEMORY], 30.0
    )
    channels = {
        resource: grpc.insecure_channel(
            f"unix://{node.socket(resource.name_with(node.settings.resource_prefix))}",
            options=[("grpc.max_receive_message_length", 64 << 20)],
        )
        for resource in Resource
    }
    try:
        yield Plugin(node, {r: api_pb2_grpc.DevicePluginStub(c) for r, c in channels.items()})
    finally:
        for channel in channels.values():
            channel.close()


# ------------------------------------------------------------------ what may be sent


def _ids(limit: int) -> st.SearchStrategy[str]:
    uuids = st.sampled_from([*HEALTHY, SICK, "GPU-deadbeef", "", "GPU-0::1"])
    return st.builds(lambda u, n: f"{u}::{n}", uuids, st.integers(0, limit))


device_id = st.one_of(
    _ids(UNITS[Resource.MEMORY] - 1),  # valid memory IDs (also valid core IDs)
    _ids(UNITS[Resource.CORE] - 1),  # valid core IDs, too high for memory
    _ids(1 << 40),
    st.sampled_from([f"{gpu_uuid(0)}::01", f"{gpu_uuid(0)}::-1", f"{gpu_uuid(0)}::", "::3"]),
    st.builds(lambda n: f"{gpu_uuid(1)}::{n}::{n}", st.integers(0, 5)),
    st.text(max_size=80),
    st.just("x" * 20_000),
)
id_lists = st.lists(device_id, max_size=60)


# ------------------------------------------------------------------ what may come back


def card_of(device_id: str) -> str:
    return device_id.rpartition("::")[0]


def check_status(error: grpc.RpcError) -> None:
    assert error.code() in ALLOWED, (error.code(), error.details())
    details = error.details() or ""
    assert details and len(details) < 2000, details[:200]


def check_still_serving(plugin: Plugin) -> None:
    for stub in plugin.stubs.values():
        options = stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=30)
        assert options.get_preferred_allocation_available


def check_preferred(
    resource: Resource, available: Sequence[str], size: int, answer: Sequence[str]
) -> None:
    assert len(answer) == len(set(answer)) <= max(size, 0)
    assert set(answer) <= set(available)  # never an ID it was not offered
    assert len({card_of(d) for d in answer}) <= 1  # one card
    for device_id in answer:
        uuid, number = card_of(device_id), int(device_id.rpartition("::")[2])
        assert uuid in HEALTHY and 0 <= number < UNITS[resource]


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    resource=st.sampled_from(list(Resource)),
    requests=st.lists(
        st.tuples(id_lists, st.lists(st.integers(0, 80), max_size=5), st.integers(-3, 120)),
        min_size=0,
        max_size=3,
    ),
)
def test_preferred_allocation_never_answers_what_it_did_not_check(
    plugin: Plugin, resource: Resource, requests: list[tuple[list[str], list[int], int]]
) -> None:
    containers = []
    for available, picks, size in requests:
        must = [available[i % len(available)] for i in picks] if available else []
        containers.append(
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
            )
        )
    try:
        reply = plugin.stubs[resource].GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(container_requests=containers), timeout=10
        )
    except grpc.RpcError as error:
        check_status(error)
    else:
        assert len(reply.container_responses) == len(containers)
        for container, response in zip(containers, reply.container_responses, strict=True):
            check_preferred(
                resource,
                container.available_deviceIDs,
                container.allocation_size,
                response.deviceIDs,
            )
    check_still_serving(plugin)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(resource=st.sampled_from(list(Resource)), requests=st.lists(id_lists, max_size=3))
def test_allocate_binds_only_checked_healthy_single_cards(
    plugin: Plugin, resource: Resource, requests: list[list[str]]
) -> None:
    try:
        reply = plugin.stubs[resource].Allocate(
            api_pb2.AllocateRequest(
                container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in requests
                ]
            ),
            timeout=30,
        )
    except grpc.RpcError as error:
        check_status(error)
    else:
        assert len(reply.container_responses) == len(requests) > 0
        for ids, response in zip(requests, reply.container_responses, strict=True):
            assert ids and len(ids) == len(set(ids))
            (uuid,) = {card_of(d) for d in ids}
            assert uuid in HEALTHY
            assert all(0 <= int(d.rpartition("::")[2]) < UNITS[resource] for d in ids)
            assert response.envs["NVIDIA_VISIBLE_DEVICES"] == uuid
    check_still_serving(plugin)


def test_huge_lists_get_an_answer_or_a_short_status(plugin: Plugin) -> None:
    valid = [f"{HEALTHY[0]}::{n}" for n in range(UNITS[Resource.MEMORY])]
    lists = {
        "unknown": [f"GPU-{n:08x}::{n}" for n in range(100_000)],
        "duplicated": [valid[0]] * 100_000,
        "repeated valid": (valid * (100_000 // len(valid) + 1))[:100_000],
        "malformed": [f"not an id {n}" for n in range(100_000)],
    }
    for resource, stub in plugin.stubs.items():
        for name, ids in lists.items():
            for call in (
                lambda ids=ids, stub=stub: stub.GetPreferredAllocation(
                    api_pb2.PreferredAllocationRequest(
                        container_requests=[
                            api_pb2.ContainerPreferredAllocationRequest(
                                available_deviceIDs=ids,
                                must_include_deviceIDs=ids[:5],
                                allocation_size=3,
                            )
                        ]
                    ),
                    timeout=30,
                ),
                lambda ids=ids, stub=stub: stub.Allocate(
                    api_pb2.AllocateRequest(
                        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
                    ),
                    timeout=30,
                ),
            ):
                try:
                    call()
                except grpc.RpcError as error:
                    check_status(error)
                else:
                    pytest.fail(f"{resource.value}: {name} list of 100 000 IDs was accepted")
    # a proper answer still comes for a proper request
    reply = plugin.stubs[Resource.MEMORY].GetPreferredAllocation(
        api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=valid, allocation_size=3
                )
            ]
        ),
        timeout=30,
    )
    check_preferred(Resource.MEMORY, valid, 3, reply.container_responses[0].deviceIDs)
    check_still_serving(plugin)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    "count", [2_000, pytest.param(10_000, marks=pytest.mark.slow)], ids=["2000", "10000"]
)
def test_thousands_of_allocations_leak_no_descriptors(plugin: Plugin, count: int) -> None:
    """Every 50th call is a memory Allocate (a cache directory on disk each time), the
    rest core, all on one card (pairing refuses a container spanning two). The daemon
    runs in this process, so /proc/self/fd counts its descriptors (and the client's).
    make test makes 2 000 calls (40 memory ones: a descriptor left per memory call or
    per core call shows); the 10 000 run under ``slow``."""
    calls = [
        (
            plugin.stubs[Resource.MEMORY if i % 50 == 0 else Resource.CORE],
            api_pb2.AllocateRequest(
                container_requests=[
                    api_pb2.ContainerAllocateRequest(
                        devices_ids=[f"{HEALTHY[0]}::{i % 29}", f"{HEALTHY[0]}::{(i + 7) % 29}"]
                    )
                ]
            ),
        )
        for i in range(100)
    ]
    for i in range(500):  # warm up: worker threads and caches exist from here on
        stub, request = calls[i % len(calls)]
        stub.Allocate(request, timeout=30)
    before = open_descriptors()
    for i in range(count):
        stub, request = calls[i % len(calls)]
        stub.Allocate(request, timeout=30)
    after = open_descriptors()
    assert after <= before, f"open descriptors grew from {before} to {after}"
    check_still_serving(plugin)


# ------------------------------------------------------------------------ non-ASCII digits

#: Digits ``str.isdigit`` accepts besides 0-9: int() reads "٣" as 3, rejects "²".
UNICODE_DIGITS = [chr(c) for c in range(0x110000) if chr(c).isdigit() and not chr(c).isascii()]


def test_unit_numbers_are_ascii_decimals_exactly_as_formatted() -> None:
    assert "٣" in UNICODE_DIGITS and "²" in UNICODE_DIGITS
    for digit in UNICODE_DIGITS:
        assert parse_unit_number(digit) is None, ascii(digit)
        assert parse_unit_number("1" + digit) is None, ascii(digit)
        with pytest.raises(InvalidDeviceIds):
            parse_device_id(f"{HEALTHY[0]}::{digit}")
    for bad in ["", "-1", "+1", " 1", "1 ", "01", "1_0", "1.0", "9" * 5000]:
        assert parse_unit_number(bad) is None, bad


@given(st.integers(0, 10**9 - 1) | st.text(max_size=12))
def test_a_unit_number_parses_only_as_the_text_gpushare_writes(value: int | str) -> None:
    text = str(value)
    number = parse_unit_number(text)
    assert number is None or str(number) == text
    if isinstance(value, int):
        assert number == value


def test_non_ascii_digits_in_the_kubelets_records_never_stop_the_refresher(node: Node) -> None:
    daemon = node.start(cards(TESLA_P4, 1), pod_resources_interval_seconds=0.05)
    assert daemon.core.refresher is not None and daemon.core.usage is not None
    refresher, usage = daemon.core.refresher, daemon.core.usage
    hostile = [f"{HEALTHY[0]}::{d}" for d in ("\u0663", "\u00b2", "\u0660", "9" * 5000, "3\u0663")]
    record = Admitted("odd", "main", "default", {node.memory: hostile}, {}, {}, {}, {}, [])
    with node.kubelet._lock:  # the stand-in serves whatever it holds in PodResources
        node.kubelet.admitted[("default", "odd", "main")] = record
    reads = refresher.reads
    assert poll(lambda: refresher.reads >= reads + 3, 30.0), "the refresher stopped reading"
    assert refresher._thread is not None and refresher._thread.is_alive()
    assert usage.used_counts(Resource.MEMORY)[HEALTHY[0]] == 0  # "٣" is not unit 3
    admitted = node.kubelet.admit("a", "main", {node.memory: 4})  # and admission goes on
    assert poll(lambda: usage.used_counts(Resource.MEMORY)[HEALTHY[0]] == 4, 30.0)
    assert len(admitted.devices[node.memory]) == 4


def test_non_ascii_digits_in_requests_are_invalid_not_internal(plugin: Plugin) -> None:
    for digit in ("\u0663", "\u00b2", "\U0001d7d1", "9" * 5000):
        ids = [f"{HEALTHY[0]}::{digit}"]
        for resource, stub in plugin.stubs.items():
            with pytest.raises(grpc.RpcError) as allocate:
                stub.Allocate(
                    api_pb2.AllocateRequest(
                        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
                    ),
                    timeout=30,
                )
            assert allocate.value.code() == grpc.StatusCode.INVALID_ARGUMENT, resource
            with pytest.raises(grpc.RpcError) as preferred:
                stub.GetPreferredAllocation(
                    api_pb2.PreferredAllocationRequest(
                        container_requests=[
                            api_pb2.ContainerPreferredAllocationRequest(
                                available_deviceIDs=ids, allocation_size=1
                            )
                        ]
                    ),
                    timeout=30,
                )
            assert preferred.value.code() == grpc.StatusCode.INVALID_ARGUMENT, resource
    check_still_serving(plugin)
