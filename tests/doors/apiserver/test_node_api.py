"""The daemon's Node and Pod annotations and pod-spec hints, against an API server double."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CARD_4GIB, NODE, TESLA_P4, Node, cards, gpu_uuid
from kit import procs
from kit.kube_double import KubeApiDouble

from gpushare.kube import apilink, nodestate


def eventually(check: Callable[[], Any]) -> Any:
    return procs.eventually(check, timeout=30.0, step=0.05)


def node_annotation(api: KubeApiDouble) -> nodestate.NodeGpuState | None:
    node = api.get("Node", NODE) or {}
    text = (node.get("metadata", {}).get("annotations") or {}).get("gpushare.io/gpus")
    return nodestate.decode(text) if text else None


def add_pod(api: KubeApiDouble, node: Node, name: str, requests: dict[str, int]) -> None:
    pod = node.pod(name, requests)
    pod["spec"]["nodeName"] = NODE
    pod["apiVersion"], pod["kind"] = "v1", "Pod"
    api.add(pod)


def test_node_annotation_and_labels_describe_every_card(node: Node, api: KubeApiDouble) -> None:
    node.start(cards(TESLA_P4, 2), node_name=NODE)
    state = eventually(lambda: node_annotation(api))
    assert state.memory_unit_mib == 256 and state.generation >= 1
    assert [
        (c.uuid, c.index, c.name, c.memory_mib, c.memory_units, c.core_units, c.healthy)
        for c in state.cards
    ] == [
        (gpu_uuid(0), 0, "Tesla P4", 7611, 29, 100, True),
        (gpu_uuid(1), 1, "Tesla P4", 7611, 29, 100, True),
    ]
    assert state.updated.endswith("Z")
    labels = api.get("Node", NODE)["metadata"]["labels"]
    assert labels == {
        "gpushare.io/gpu.product": "Tesla-P4",
        "gpushare.io/gpu.count": "2",
        "gpushare.io/gpu.memory": "7611",
        # which backend holds each card's limits (docs/choosing.md#enforcement-backends)
        "gpushare.io/memory-enforcement": "interposer",
        "gpushare.io/memory-enforcement.interposer": "2",
        "gpushare.io/compute-enforcement": "interposer",
        "gpushare.io/compute-enforcement.interposer": "2",
    }


def test_admitted_pods_are_annotated_and_use_is_published(node: Node, api: KubeApiDouble) -> None:
    node.start(cards(TESLA_P4, 2), node_name=NODE)
    eventually(lambda: node_annotation(api))
    patches_before = len(api.calls("PATCH", f"/nodes/{NODE}"))
    for name in ("a", "b", "c"):
        add_pod(api, node, name, {node.memory: 5, node.core: 10})
    began = time.monotonic()
    admitted = {
        n: node.kubelet.admit(n, "main", {node.memory: 5, node.core: 10}) for n in ("a", "b", "c")
    }
    burst = time.monotonic() - began
    for name, record in admitted.items():
        eventually(
            lambda n=name: (api.get("Pod", n, "default")["metadata"].get("annotations") or {}).get(
                "gpushare.io/gpu.main"
            )
        )
        annotations = api.get("Pod", name, "default")["metadata"]["annotations"]
        assert annotations["gpushare.io/gpu.main"] == record.card()
    state = eventually(
        lambda: (
            (s := node_annotation(api)) and sum(c.memory_units_used for c in s.cards) == 15 and s
        )
    )
    assert sum(c.core_units_used for c in state.cards) == 30
    # Six allocations in a burst: debounced into far fewer Node updates. Writes are kept
    # MIN_PUBLISH_INTERVAL apart: at most one per interval the burst spans, and one after
    # it; 3 where the burst takes under an interval (a quiet machine). A loaded machine
    # stretches the burst (each admission is gRPC calls), not the rule.
    bound = max(3, 2 + math.ceil(burst / apilink.MIN_PUBLISH_INTERVAL))
    assert len(api.calls("PATCH", f"/nodes/{NODE}")) - patches_before <= bound, burst
    # ...and each container annotated once, not once per resource.
    link = node.daemon.core.api_link if node.daemon is not None else None
    assert link is not None
    eventually(lambda: link.annotator.handled >= 6)
    for name in ("a", "b", "c"):
        assert len(api.calls("PATCH", f"/namespaces/default/pods/{name}")) == 1, name


def test_a_pod_deleted_before_its_annotation_does_not_hold_up_the_others(
    node: Node, api: KubeApiDouble
) -> None:
    node.start(cards(TESLA_P4, 1), node_name=NODE)
    eventually(lambda: node_annotation(api))
    node.kubelet.admit("gone", "main", {node.memory: 2})  # never in the API: patch gets 404
    add_pod(api, node, "b", {node.memory: 2})
    node.kubelet.admit("b", "main", {node.memory: 2})
    eventually(
        lambda: (api.get("Pod", "b", "default")["metadata"].get("annotations") or {}).get(
            "gpushare.io/gpu.main"
        )
    )
    assert len(api.calls("PATCH", "/pods/gone")) == 1


def test_allocate_is_unaffected_while_the_api_is_down(node: Node, api: KubeApiDouble) -> None:
    api.fail_next(1000, status=500)
    node.start(cards(TESLA_P4, 1), node_name=NODE)
    api.hold()  # and now hanging: an Allocate that waited for it would never answer
    admitted: list[str] = []
    admission = threading.Thread(
        target=lambda: admitted.append(node.kubelet.admit("a", "main", {node.memory: 4}).card())
    )
    admission.start()
    admission.join(60)
    answered = not admission.is_alive()
    api.release()
    assert answered and admitted == [gpu_uuid(0)]
    assert node_annotation(api) is None
    eventually(lambda: api.calls("PATCH") or api.calls("GET"))
    api.fail_next(0)
    with api._lock:
        api._failures.clear()  # the API server comes back
    state = eventually(
        lambda: (s := node_annotation(api)) and s.cards[0].memory_units_used == 4 and s
    )
    assert state.cards[0].uuid == gpu_uuid(0)


def test_generation_continues_from_the_existing_annotation(node: Node, api: KubeApiDouble) -> None:
    old = nodestate.NodeGpuState(41, "2026-01-01T00:00:00Z", 256, ())
    node_obj = api.get("Node", NODE)
    node_obj["metadata"]["annotations"] = {"gpushare.io/gpus": nodestate.encode(old)}
    api.add(node_obj)
    node.start(cards(TESLA_P4, 1), node_name=NODE)
    assert eventually(lambda: (s := node_annotation(api)) and s.generation > 41)


@pytest.mark.parametrize("core_first", [True, False])
def test_pod_specs_from_the_api_place_a_pair_after_a_single_resource_container(
    node: Node, api: KubeApiDouble, core_first: bool
) -> None:
    node.start(cards(CARD_4GIB, 2), node_name=NODE)
    add_pod(api, node, "a", {node.memory: 10})
    a = node.kubelet.admit("a", "main", {node.memory: 10})
    add_pod(api, node, "b", {node.memory: 10, node.core: 50})  # bound just before admission
    order = [node.core, node.memory] if core_first else [node.memory, node.core]
    b = node.kubelet.admit("b", "main", {node.memory: 10, node.core: 50}, order=order)
    assert b.card() != a.card()
    assert {d.split("::")[0] for ids in b.devices.values() for d in ids} == {b.card()}


def test_annotation_is_valid_json_with_the_documented_keys(node: Node, api: KubeApiDouble) -> None:
    node.start(cards(TESLA_P4, 1), node_name=NODE)
    eventually(lambda: node_annotation(api))
    raw = json.loads(api.get("Node", NODE)["metadata"]["annotations"]["gpushare.io/gpus"])
    assert set(raw) == {"version", "generation", "updated", "memoryUnitMiB", "gpus", "enforcement"}
    assert raw["enforcement"] == [
        {"uuid": gpu_uuid(0), "index": 0, "memory": "interposer", "compute": "interposer",
         "why": raw["enforcement"][0]["why"]}
    ]  # fmt: skip
    assert "not driver" in raw["enforcement"][0]["why"]
    assert set(raw["gpus"][0]) == {
        "uuid",
        "index",
        "name",
        "memory_mib",
        "memory_units",
        "memory_units_used",
        "core_units",
        "core_units_used",
        "healthy",
        "held_by",
        "hardware_healthy",
        "pods",
        "pods_truncated",
    }


def test_pod_annotation_keys_stay_valid_for_long_container_names() -> None:
    long_name = "a-container-name-that-is-as-long-as-kubernetes-allows-it-to-bee"
    assert len(long_name) == 63
    key = nodestate.pod_annotation_key("gpushare.io", long_name)
    prefix, _, name = key.partition("/")
    assert prefix == "gpushare.io" and len(name) <= 63 and name.startswith("gpu.a-container")
    assert key != nodestate.pod_annotation_key("gpushare.io", long_name[:-1] + "y")
    assert nodestate.pod_annotation_key("gpushare.io", "main") == "gpushare.io/gpu.main"


def test_a_missing_kubeconfig_names_what_failed_and_how_to_turn_the_link_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from gpushare.kube.apilink import ApiConfigMissing, connect_api

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    with pytest.raises(ApiConfigMissing) as error:
        connect_api()
    message = str(error.value)
    assert f"the kubeconfig {tmp_path / 'missing-kubeconfig'}" in message
    assert "--node-name ''" in message and "\n" not in message


def test_a_kubelet_restart_is_published_until_the_records_list_every_holder_again(
    node: Node, api: KubeApiDouble
) -> None:
    """Issue 32.14: the extender sends no pod to the node while ``kubeletRestarted``
    is published; the daemon clears it once the restarted kubelet lists the pod again."""
    node.start(cards(TESLA_P4, 2), node_name=NODE)
    eventually(lambda: node_annotation(api))
    add_pod(api, node, "running", {node.memory: 5})
    node.kubelet.admit("running", "main", {node.memory: 5})
    assert node.daemon is not None
    assert node.daemon.core.refresher.refresh_once()
    count = len(node.kubelet.registrations)
    node.kubelet.restart(empty_pod_manager=True)
    assert node.kubelet.wait_for(lambda k: len(k.registrations) >= count + 2, 30.0)
    state = eventually(lambda: (s := node_annotation(api)) and s.kubelet_restarted and s)
    assert state.kubelet_restarted.endswith("Z")
    node.kubelet.pods_synced()  # the first batch admitted: every pod listed again
    node.daemon.core.refresher.refresh_once()
    eventually(lambda: (s := node_annotation(api)) and not s.kubelet_restarted)
