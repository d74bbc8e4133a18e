"""Scenario 4: the daemon's credentials (its ServiceAccount's token bound to its pod on
node-1, as the kubelet would mount it) with the project's RBAC and node-scope policy, judged by
the real API server: its own Node, its node's pods and its node's state object (ConfigMap
gpushare-node-node-1) yes, anything else no."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kube_cluster import MEMORY, Api, Cluster, pod_manifest, wait_for

from gpushare.kube import nodestate, stateobject

CONFIGMAPS = "/api/v1/namespaces/kube-system/configmaps"


@pytest.fixture(scope="module")
def daemon_api(cluster: Cluster) -> Api:
    agent = cluster.nodes["node-1"]
    token = cluster.token_for_pod("kube-system", "gpushare", agent.daemon_pod)
    return cluster.api.as_token(token)


@pytest.fixture(scope="module")
def pods_on_both(cluster: Cluster) -> Iterator[None]:
    for node in ("node-1", "node-2"):
        cluster.create_pod(pod_manifest(f"scope-{node}", {}, node=node))
    for node in ("node-1", "node-2"):
        cluster.wait_pod("default", f"scope-{node}", "Running")
    yield
    for node in ("node-1", "node-2"):
        cluster.delete_pod("default", f"scope-{node}")


def annotate(api: Api, path: str, key: str, value: str) -> int:
    return api.patch(path, {"metadata": {"annotations": {key: value}}}).status_code


def test_the_daemon_may_annotate_its_own_node(cluster: Cluster, daemon_api: Api) -> None:
    assert annotate(daemon_api, "/api/v1/nodes/node-1", "gpushare.io/e2e", "own") == 200
    node = cluster.node("node-1")
    assert node["metadata"]["annotations"]["gpushare.io/e2e"] == "own"


def test_the_daemon_may_not_patch_another_node(cluster: Cluster, daemon_api: Api) -> None:
    reply = daemon_api.patch(
        "/api/v1/nodes/node-2", {"metadata": {"annotations": {"gpushare.io/e2e": "other"}}}
    )
    assert reply.status_code == 403, reply.text
    assert "may change only its own Node" in reply.json()["message"]
    assert "gpushare.io/e2e" not in cluster.node("node-2")["metadata"].get("annotations", {})


def test_the_daemon_may_not_change_other_keys_of_its_node(daemon_api: Api) -> None:
    for body in (
        {"metadata": {"annotations": {"example.com/other": "x"}}},
        {"metadata": {"labels": {"gpushare.io/enabled": "false"}}},
        {"metadata": {"labels": {"example.com/other": "x"}}},
        {"spec": {"unschedulable": True}},
    ):
        reply = daemon_api.patch("/api/v1/nodes/node-1", body)
        assert reply.status_code == 403, (body, reply.text)


def test_the_daemon_may_annotate_pods_on_its_node_only(
    cluster: Cluster, daemon_api: Api, pods_on_both: None
) -> None:
    own = "/api/v1/namespaces/default/pods/scope-node-1"
    other = "/api/v1/namespaces/default/pods/scope-node-2"
    assert annotate(daemon_api, own, "gpushare.io/gpu.main", "e2e") == 200
    reply = daemon_api.patch(other, {"metadata": {"annotations": {"gpushare.io/gpu.main": "x"}}})
    assert reply.status_code == 403, reply.text
    assert "may change only pods on its own node" in reply.json()["message"]
    assert annotate(daemon_api, own, "example.com/other", "x") == 403


def test_rbac_gives_the_daemon_nothing_else(daemon_api: Api) -> None:
    assert daemon_api.request("GET", "/api/v1/namespaces/kube-system/secrets").status_code == 403
    assert daemon_api.request("DELETE", "/api/v1/nodes/node-2").status_code == 403
    reply = daemon_api.create(pod_manifest("rbac-probe", {}), dry_run=True)
    assert reply.status_code == 403
    # ... and what it needs: list and watch pods of its node, read its Node.
    assert (
        daemon_api.request(
            "GET", "/api/v1/pods", params={"fieldSelector": "spec.nodeName=node-1"}
        ).status_code
        == 200
    )
    assert daemon_api.request("GET", "/api/v1/nodes/node-1").status_code == 200


def test_the_daemons_own_writes_pass_the_policy(cluster: Cluster) -> None:
    """What the daemon writes with that token gets through the real policy: the per-card
    state on its Node, and the card annotation on a pod it served."""

    # written by the daemon's API link on a thread of its own, after its registration:
    # with this test run alone (or first) the cluster has just started
    def published() -> dict[str, Any] | None:
        node = cluster.node("node-1")
        meta = node["metadata"]
        labelled = "gpushare.io/gpu.count" in (meta.get("labels") or {})
        return node if labelled and "gpushare.io/gpus" in (meta.get("annotations") or {}) else None

    node = wait_for("the daemon's state and labels on its Node", published, 60)
    state = json.loads(node["metadata"]["annotations"]["gpushare.io/gpus"])
    assert len(state["gpus"]) == 3
    assert node["metadata"]["labels"]["gpushare.io/gpu.count"] == "3"
    assert node["metadata"]["labels"]["gpushare.io/gpu.product"] == "Tesla-P4"
    cluster.create_pod(pod_manifest("scope-served", {MEMORY: 4}, node="node-1"))
    try:
        cluster.wait_pod("default", "scope-served", "Running")
        env = cluster.wait_record("node-1", "default", "scope-served", "main")["env"]

        def annotated() -> str | None:
            pod = cluster.pod("default", "scope-served") or {}
            return pod.get("metadata", {}).get("annotations", {}).get("gpushare.io/gpu.main")

        value = wait_for("the daemon's annotation on its pod", annotated, 60)
        assert env["NVIDIA_VISIBLE_DEVICES"] in value
    finally:
        cluster.delete_pod("default", "scope-served")


def _state_object(cluster: Cluster, node: str, **meta: object) -> dict[str, object]:
    uid = cluster.node(node)["metadata"]["uid"]
    obj = stateobject.state_object("gpushare.io", "kube-system", node, uid, "{}")
    obj["metadata"].update(meta)
    return obj


def test_the_daemon_publishes_its_state_object_through_the_policy(cluster: Cluster) -> None:
    """The daemon (mode both, the default) created and keeps ConfigMap gpushare-node-node-1
    with its token: owned by the Node, the same state as the annotation."""

    def published() -> dict[str, object] | None:
        reply = cluster.api.request("GET", f"{CONFIGMAPS}/gpushare-node-node-1")
        return reply.json() if reply.status_code == 200 else None

    found = wait_for("the daemon's state object", published, 60)
    node = cluster.node("node-1")
    read = stateobject.read_state_object(found, "gpushare.io")
    assert (read.node, read.problem, read.owner_uid) == ("node-1", "", node["metadata"]["uid"])
    assert len(nodestate.decode(read.text or "").cards) == 3


def test_the_daemon_may_write_no_other_state_object_and_no_other_configmap(
    cluster: Cluster, daemon_api: Api
) -> None:
    other_node = _state_object(cluster, "node-2")
    reply = daemon_api.create(other_node)
    assert reply.status_code == 403, reply.text
    assert "may write only the ConfigMap gpushare-node-node-1" in reply.json()["message"]
    # its own name, but naming or owned by another node
    for forged in (
        _state_object(cluster, "node-1", annotations={"gpushare.io/node": "node-2"}),
        _state_object(
            cluster,
            "node-1",
            ownerReferences=[{"apiVersion": "v1", "kind": "Node", "name": "node-2", "uid": "x"}],
        ),
    ):
        forged["metadata"]["name"] = "gpushare-node-node-1"
        assert daemon_api.create(forged).status_code in (403, 409)
        reply = daemon_api.patch(
            f"{CONFIGMAPS}/gpushare-node-node-1", {"metadata": forged["metadata"]}
        )
        assert reply.status_code == 403, reply.text
    any_other = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "coredns-like", "namespace": "kube-system"},
        "data": {"x": "y"},
    }
    assert daemon_api.create(any_other).status_code == 403
    # Delete: only its own state object (a daemon leaving the object mode retires it): RBAC
    # lets it delete ConfigMaps in its namespace, the policy only that one name.
    made = cluster.api.request("POST", CONFIGMAPS, json=any_other)
    assert made.status_code == 201, made.text
    try:
        reply = daemon_api.request("DELETE", f"{CONFIGMAPS}/coredns-like")
        assert reply.status_code == 403, reply.text
        assert "may delete only the ConfigMap gpushare-node-node-1" in reply.json()["message"]
    finally:
        cluster.api.request("DELETE", f"{CONFIGMAPS}/coredns-like")
    # ... no list, and nothing outside its namespace
    assert daemon_api.request("GET", CONFIGMAPS).status_code == 403
    elsewhere = _state_object(cluster, "node-1", namespace="default")
    assert daemon_api.create(elsewhere).status_code == 403
