"""A resource prefix of one's own (``--resource-prefix example.com``) with the chart's RBAC and
policies rendered for it (``config.resourcePrefix``), on a cluster of its own: the daemon
registers example.com/* with the real kubelet, its writes pass the chart's node-scope policy,
the chart's core-needs-memory policy guards the example.com resources. (The plain manifests in
daemonset/policies/ are written for gpushare.io: with another prefix they refuse the daemon's
Node updates, see e2e/README.md.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
import yaml
from e2e_nodes import CARD_4GIB, cards
from kube_cluster import REPO, Cluster, NodeSpec, pod_manifest, running_cluster, wait_for

PREFIX = "example.com"
MEMORY, CORE = f"{PREFIX}/vcuda-memory", f"{PREFIX}/vcuda-core"
KINDS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


def chart_objects() -> list[dict[str, Any]]:
    with helm_python.Chart.load(REPO / "charts" / "gpushare") as chart:
        rendered = chart.render(
            {"config": {"resourcePrefix": PREFIX}},
            name="gpushare",
            namespace="kube-system",
            is_install=True,
        )
    return [
        o
        for path, text in rendered.items()
        if path.endswith(".yaml")
        for o in yaml.safe_load_all(text)
        if o and o["kind"] in KINDS
    ]


@pytest.fixture(scope="module")
def prefixed() -> Iterator[Cluster]:
    spec = NodeSpec("node-1", cards(5, CARD_4GIB, 2), daemon_args=["--resource-prefix", PREFIX])
    logs = REPO / "e2e" / "logs" / "prefix-cluster"
    with running_cluster([], logs=logs, install=False) as c:
        c.api.apply_all(chart_objects())
        c.wait_policies_in_force()
        c.add_node(spec)
        yield c


def test_the_daemon_registers_the_prefixed_resources(prefixed: Cluster) -> None:
    alloc = prefixed.allocatable("node-1")
    assert (alloc[MEMORY], alloc[CORE]) == ("32", "200")
    assert "gpushare.io/vcuda-memory" not in alloc


def test_the_daemons_writes_pass_the_charts_policy(prefixed: Cluster) -> None:
    # the daemon's API link writes the Node's annotation on a thread of its own, after the
    # resources registered (what the fixture waited for): wait for its first write
    def published() -> str | None:
        annotations = prefixed.node("node-1")["metadata"].get("annotations") or {}
        return annotations.get(f"{PREFIX}/gpus")

    state = json.loads(wait_for("the daemon's state on its Node", published, 60))
    assert len(state["gpus"]) == 2
    prefixed.create_pod(pod_manifest("prefixed", {MEMORY: 4, CORE: 10}, node="node-1"))
    try:
        prefixed.wait_pod("default", "prefixed", "Running")
        env = prefixed.wait_record("node-1", "default", "prefixed", "main")["env"]
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m"

        def annotated() -> str | None:
            pod = prefixed.pod("default", "prefixed") or {}
            return pod.get("metadata", {}).get("annotations", {}).get(f"{PREFIX}/gpu.main")

        assert wait_for("the daemon's annotation on its pod", annotated, 60)
    finally:
        prefixed.delete_pod("default", "prefixed")


def test_the_charts_policy_guards_the_prefixed_resources(prefixed: Cluster) -> None:
    reply = prefixed.api.create(pod_manifest("core-only", {CORE: 10}), dry_run=True)
    assert reply.status_code == 422, reply.text
    assert f"ask for {CORE} without {MEMORY}" in reply.json()["message"]
