"""Pod lists in protobuf: answers recorded from kube-apiserver v1.36.3 (tests/data/kubeapi)
read by ProtoListStream give the extender the same facts as the JSON answers, however
the bytes arrive; a broken answer is one ValueError; and the pod feed lists a server
that answers in protobuf over real HTTP."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kit.kube_double import KubeApiDouble

from gpushare._proto.kubeapi.v1 import pods_pb2
from gpushare.extender.ledger import AdmissionLedger
from gpushare.extender.podfeed import PodFeed, _matters, _may_matter, facts_of
from gpushare.kube.nodestate import plan_annotation_key
from gpushare.kube.protolist import MAX_ITEM_BYTES, ProtoListStream, pod_object, quantity_names
from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint

DATA = Path(__file__).resolve().parents[2] / "data" / "kubeapi"
PREFIX = "gpushare.io"
PAGES = [(DATA / f"pods-page{n}.pb").read_bytes() for n in (1, 2)]
JSON_PAGES = [json.loads((DATA / f"pods-page{n}.json").read_bytes()) for n in (1, 2)]


def read_all(data: bytes, sizes: Iterator[int] | None = None) -> tuple[list[bytes], str, str]:
    """The items of one answer whose bytes arrive in reads of ``sizes`` (all at once
    when None), and the list's resourceVersion and continue token."""
    source = io.BytesIO(data)

    def read(size: int) -> bytes:
        return source.read(min(size, next(sizes)) if sizes is not None else size)

    stream = ProtoListStream(read, chunk=7)
    items = list(stream.items())
    return items, stream.resource_version, stream.continue_token


def kept(pod: dict[str, Any]) -> Any:
    return facts_of(pod, PREFIX) if _may_matter(pod, PREFIX) else None


def proto_pod(raw: bytes) -> dict[str, Any]:
    return pod_object(pods_pb2.Pod.FromString(raw), (plan_annotation_key(PREFIX),), PREFIX + "/")


@pytest.mark.parametrize("page", [0, 1])
def test_a_recorded_page_gives_the_facts_and_metadata_of_its_json_twin(page: int) -> None:
    items, version, token = read_all(PAGES[page])
    twin = JSON_PAGES[page]
    assert version == twin["metadata"]["resourceVersion"]
    assert token == twin["metadata"].get("continue", "")
    assert [kept(proto_pod(raw)) for raw in items] == [kept(pod) for pod in twin["items"]]


def test_the_cheap_test_on_a_decoded_pod_agrees_with_the_one_on_its_json() -> None:
    for page, twin in zip(PAGES, JSON_PAGES, strict=True):
        for raw, pod in zip(read_all(page)[0], twin["items"], strict=True):
            decoded = pods_pb2.Pod.FromString(raw)
            on_proto = _matters(decoded.status.phase, quantity_names(decoded), PREFIX)
            assert on_proto == _may_matter(pod, PREFIX)
            assert on_proto == (pod["metadata"]["name"] != "no-gpu")


def test_the_recorded_pods_are_the_cases_the_extender_tells_apart() -> None:
    pods = [proto_pod(raw) for page in PAGES for raw in read_all(page)[0]]
    facts = {pod["metadata"]["name"]: kept(pod) for pod in pods}
    assert facts["no-gpu"] is None
    assert facts["gpu-done"].ended and facts["gpu-done"].node == "node-00001"
    assert facts["gpu-unbound"].node == "" and facts["gpu-unbound"].need is not None
    planned = facts["gpu-planned"]
    assert planned.plan == (("main", "GPU-11111111-2222-3333-4444-555555555555"),)
    assert [(c.name, c.memory_units, c.core_units) for c in planned.need.containers] == [
        ("main", 16, 30)
    ]
    sidecar = facts["gpu-sidecar"].need
    assert [(c.name, c.memory_units) for c in sidecar.containers] == [("proxy", 2), ("main", 8)]
    assert [(c.name, c.memory_units) for c in sidecar.init_containers] == [("setup", 4)]
    # only the plan of the annotations, only the prefix's quantities, are copied
    planned_pod = next(p for p in pods if p["metadata"]["name"] == "gpu-planned")
    assert list(planned_pod["metadata"]["annotations"]) == [plan_annotation_key(PREFIX)]
    assert all(
        name.startswith(PREFIX + "/")
        for c in planned_pod["spec"]["containers"]
        for name in c["resources"]["limits"]
    )


@given(st.lists(st.integers(1, 64), min_size=1))
def test_any_way_the_bytes_arrive_gives_the_same_items(sizes: list[int]) -> None:
    def cycle() -> Iterator[int]:
        while True:
            yield from sizes

    for page in PAGES:
        assert read_all(page, cycle()) == read_all(page)


def test_an_answer_cut_before_its_list_ends_is_one_value_error() -> None:
    page = PAGES[1]
    whole = read_all(page)
    # the Unknown's fields after ``raw`` (its empty encoding and type) may be lost
    list_end = len(page) - len(b"\x1a\x00\x22\x00")
    assert page[list_end:] == b"\x1a\x00\x22\x00"
    for cut in range(list_end):
        with pytest.raises(ValueError):
            read_all(page[:cut])
    for cut in (list_end, list_end + 2):  # between two whole fields of the Unknown
        assert read_all(page[:cut]) == whole


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def framed(list_body: bytes) -> bytes:
    return b"k8s\x00" + b"\x12" + varint(len(list_body)) + list_body


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b'{"kind": "PodList"}', "not a Kubernetes protobuf answer"),
        (b"k8s\x00\x0a\x00", "holds no list"),
        (framed(b"\x12" + varint(MAX_ITEM_BYTES + 1)), "bytes in the list answer"),
        (framed(b"\x13"), "wire type 3"),
        (framed(b"\x08" + b"\xff" * 11), "malformed varint"),
        (framed(b"\x12\x05abc") + b"de", "runs past the end of the list"),
    ],
)
def test_a_broken_answer_is_one_clear_value_error(answer: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_all(answer)


def pod(name: str, memory: int = 0, phase: str = "Running") -> dict[str, Any]:
    limits = {f"{PREFIX}/vcuda-memory": str(memory)} if memory else {"cpu": "1"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": limits}}]},
        "status": {"phase": phase},
    }


def list_through_the_feed(short_tmp: Path, protobuf: bool) -> tuple[list[Any], str, str, list[Any]]:
    """The pod feed's list of a double holding 1 203 pods (three pages of 500 and a
    bit; every third asks for no GPU, one ended): (facts, version, encoding, requests)."""
    api = KubeApiDouble()
    api.protobuf = protobuf
    api.start()
    try:
        for index in range(1203):
            phase = "Succeeded" if index == 7 else "Running"
            api.add(pod(f"p{index}", memory=index % 3, phase=phase))
        client = ApiClient(kubeconfig_endpoint(api.kubeconfig(short_tmp / "kubeconfig")))
        loop = asyncio.new_event_loop()
        try:
            feed = PodFeed(client, PREFIX, AdmissionLedger(timeout_seconds=60.0), loop)
            listed, version = feed.list_pods()
        finally:
            loop.close()
        return listed, version, feed.encoding, [r for r in api.requests if r.path == "/api/v1/pods"]
    finally:
        api.stop()


@pytest.mark.parametrize("protobuf", [True, False], ids=["protobuf", "json-only server"])
def test_the_pod_feed_lists_in_protobuf_or_in_the_json_a_server_answers(
    short_tmp: Path, protobuf: bool
) -> None:
    listed, version, encoding, lists = list_through_the_feed(short_tmp, protobuf)
    assert encoding == ("protobuf" if protobuf else "json")
    assert len(lists) == 3
    assert all(r.accept.startswith("application/vnd.kubernetes.protobuf") for r in lists)
    # the first page from the watch cache, as informers ask; the rest by token
    assert [r.query.get("resourceVersion") for r in lists] == [["0"], None, None]
    names = sorted(f.key for f in listed)
    assert names == sorted(f"team/p{i}" for i in range(1203) if i % 3 or i == 7)
    assert version and int(version) > 0
    assert next(f for f in listed if f.key == "team/p7").ended
