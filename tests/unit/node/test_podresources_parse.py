"""The incremental reader of the kubelet's List answers agrees with decoding each answer
whole, over random answers and random sequences of them, and refuses garbage cleanly."""

from __future__ import annotations

import sys

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.sizes import at_two_sizes

from gpushare._proto.podresources.v1 import api_pb2 as pr
from gpushare.node.podresources import ListParser, parse_list_response, pod_entries
from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot

MEMORY, CORE, WHOLE = "gpushare.io/vcuda-memory", "gpushare.io/vcuda-core", "gpushare.io/gpu"
RESOURCES = {MEMORY: Resource.MEMORY, CORE: Resource.CORE}
EXCLUSIVE = (WHOLE,)

names = st.sampled_from(["a", "b", "c", "pod-1", "é"])
device_ids = st.lists(
    st.builds(lambda c, n: f"GPU-{c}::{n}", st.integers(0, 2), st.integers(0, 9)), max_size=3
)
devices = st.builds(
    lambda resource, ids: pr.ContainerDevices(resource_name=resource, device_ids=ids),
    st.sampled_from([MEMORY, CORE, WHOLE, "nvidia.com/gpu"]),
    device_ids,
)
containers = st.builds(
    lambda name, found: pr.ContainerResources(name=name, devices=found),
    names,
    st.lists(devices, max_size=4),
)
pods = st.builds(
    lambda namespace, name, found: pr.PodResources(
        namespace=namespace, name=name, containers=found
    ),
    names,
    names,
    st.lists(containers, max_size=3),
)
answers = st.lists(pods, max_size=6).map(
    lambda found: pr.ListPodResourcesResponse(pod_resources=found)
)


def whole(answer: pr.ListPodResourcesResponse) -> Snapshot:
    return parse_list_response(answer, RESOURCES, 1.0, EXCLUSIVE)


def same(a: Snapshot, b: Snapshot) -> bool:
    # used_counts: the parser sums each pod's own counts; decoding whole counts the IDs
    return (a.holders, a.devices, a.exclusive, a.used_counts) == (
        b.holders,
        b.devices,
        b.exclusive,
        b.used_counts,
    )


@at_two_sizes(given(st.lists(answers, min_size=1, max_size=6)), quick=60, full=300, deadline=None)
def test_each_answer_of_a_sequence_reads_as_decoded_whole(
    sequence: list[pr.ListPodResourcesResponse],
) -> None:
    parser = ListParser(RESOURCES, EXCLUSIVE)
    for answer in sequence:  # the parser keeps pods from one answer to the next
        data = answer.SerializeToString()
        assert [pr.PodResources.FromString(e) for e in pod_entries(data)] == list(
            answer.pod_resources
        )
        assert same(parser.parse(data, 1.0), whole(answer))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_bytes_that_are_not_an_answer_are_refused_or_read_as_protobuf_would(data: bytes) -> None:
    parser = ListParser(RESOURCES, EXCLUSIVE)
    try:
        expected = whole(pr.ListPodResourcesResponse.FromString(data))
    except DecodeError:
        with pytest.raises(DecodeError):
            parser.parse(data, 1.0)
        return
    assert same(parser.parse(data, 1.0), expected)


def _answer(pods: int, devices_each: int, newcomer: bool) -> bytes:
    """``pods`` pods of one container, each holding ``devices_each`` memory units and one
    core unit of its own on card ``i % 2``, one entry per device as the kubelet lists
    them; and, with ``newcomer``, one more pod holding one unit."""

    def pod(name: str, card: int, first: int, units: int) -> pr.PodResources:
        ids = [f"GPU-{card}::{n}" for n in range(first, first + units)]
        entries = [pr.ContainerDevices(resource_name=MEMORY, device_ids=[d]) for d in ids]
        entries.append(pr.ContainerDevices(resource_name=CORE, device_ids=[ids[0]]))
        return pr.PodResources(
            namespace="default",
            name=name,
            containers=[pr.ContainerResources(name="main", devices=entries)],
        )

    found = [pod(f"pod-{i}", i % 2, i // 2 * devices_each, devices_each) for i in range(pods)]
    if newcomer:
        found.append(pod("newcomer", 0, 100_000, 1))
    return pr.ListPodResourcesResponse(pod_resources=found).SerializeToString()


def _python_steps(parser: ListParser, data: bytes) -> tuple[int, Snapshot]:
    """The answer read as the binder reads it (the snapshot and its per-card counts),
    and how many Python and C function calls that took: a count of work that no machine
    load changes, unlike a time."""
    steps = 0

    def count(_frame: object, _event: str, _arg: object) -> None:
        nonlocal steps
        steps += 1

    sys.setprofile(count)
    try:
        snapshot = parser.parse(data, 2.0)
        snapshot.used_counts  # noqa: B018  (what other_free_in reads on every call)
    finally:
        sys.setprofile(None)
    return steps, snapshot


def test_a_read_costs_per_pod_changed_not_per_device_held() -> None:
    """GetPreferredAllocation reads the kubelet's records on every call, and the kubelet
    lists one entry per device: 4 488 on a full 8 x H200 node. Reading an answer in which
    one pod is new decodes that pod alone, and the rest of the work (joining the pods,
    the per-card counts) is the same whether the pods already there hold 4 devices each
    or 64."""
    steps = []
    for devices_each in (4, 64):
        parser = ListParser(RESOURCES, EXCLUSIVE)
        parser.parse(_answer(12, devices_each, newcomer=False), 1.0)
        decoded = parser.decoded
        taken, snapshot = _python_steps(parser, _answer(12, devices_each, newcomer=True))
        assert parser.decoded - decoded == 1  # the newcomer, nothing else
        assert snapshot.used_counts[Resource.MEMORY] == {
            "GPU-0": 6 * devices_each + 1,
            "GPU-1": 6 * devices_each,
        }
        assert same(
            snapshot,
            whole(pr.ListPodResourcesResponse.FromString(_answer(12, devices_each, newcomer=True))),
        )
        steps.append(taken)
    assert steps[0] == steps[1], f"steps per read grew with the devices held: {steps}"
