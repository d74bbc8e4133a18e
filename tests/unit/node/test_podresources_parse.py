"""The incremental reader of the kubelet's List answers agrees with decoding each answer
whole, over random answers and random sequences of them, and refuses garbage cleanly."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=300, deadline=None)
@given(st.lists(answers, min_size=1, max_size=6))
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
