"""Scenario 2 with the project's scheduler extender (gpushare-scheduler-extender): as the
``gpushare-scheduler`` profile of daemonset/scheduler/scheduler.yaml beside the stock scheduler,
and as the sample configuration daemonset/extender/scheduler-config.yaml in place of it. The
real kube-scheduler calls the extender; pods no single card holds stay Pending instead of
failing admission on the node."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
import yaml
from e2e_nodes import NODES
from kube_cluster import CORE, MEMORY, REPO, Cluster, load_manifests, pod_manifest

PROFILE = "gpushare-scheduler"


def profile_config(source: str) -> dict[str, Any]:
    """The KubeSchedulerConfiguration of the gpushare-scheduler ConfigMap: from
    daemonset/scheduler/scheduler.yaml, or from the chart rendered with scheduler.enabled.
    Only kube-scheduler itself validates it (the API server stores a ConfigMap as it is)."""
    if source == "daemonset":
        objects = load_manifests(REPO / "daemonset" / "scheduler" / "scheduler.yaml")
    else:
        with helm_python.Chart.load(REPO / "charts" / "gpushare") as chart:
            rendered = chart.render(
                {"scheduler": {"enabled": True}},
                name="gpushare",
                namespace="kube-system",
                is_install=True,
            )
        objects = [
            o
            for path, text in rendered.items()
            if path.endswith(".yaml")  # not NOTES.txt
            for o in yaml.safe_load_all(text)
            if o
        ]
    (cm,) = [
        o for o in objects if o.get("kind") == "ConfigMap" and o["metadata"]["name"] == PROFILE
    ]
    config: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return config


def sample_config() -> dict[str, Any]:
    (config,) = load_manifests(REPO / "daemonset" / "extender" / "scheduler-config.yaml")
    return config


def card_of(cluster: Cluster, node: str, pod: str, container: str = "main") -> str:
    env = cluster.wait_record(node, "default", pod, container)["env"]
    card = env["NVIDIA_VISIBLE_DEVICES"]
    assert card in {g["uuid"] for g in next(n for n in NODES if n.name == node).gpus}
    return str(card)


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        cluster.delete_pod("default", name)


@pytest.fixture(scope="module")
def extender(cluster: Cluster) -> Iterator[None]:
    cluster.start_extender()
    yield
    assert cluster.extender is not None
    cluster.extender.stop()
    cluster.extender = None


@pytest.fixture(scope="module", params=["daemonset", "chart"])
def gpushare_scheduler(
    cluster: Cluster, extender: None, request: pytest.FixtureRequest
) -> Iterator[str]:
    """The gpushare-scheduler profile: a second kube-scheduler calling the extender, with
    the configuration of daemonset/scheduler/ or of the chart."""
    cluster.start_scheduler(profile_config(request.param), name=PROFILE)
    yield PROFILE
    cluster.stop_scheduler(PROFILE)


def test_the_profile_places_on_the_node_whose_card_holds_the_pod(
    cluster: Cluster, gpushare_scheduler: str, pods: list[str]
) -> None:
    # 20 units: node-2's total (32) would do, but only node-1's 29-unit cards hold them.
    for i in range(3):
        name = f"ext-big-{i}"
        pods.append(name)
        cluster.create_pod(pod_manifest(name, {MEMORY: 20, CORE: 10}, scheduler=PROFILE))
    for i in range(3):
        pod = cluster.wait_pod("default", f"ext-big-{i}", "Running")
        assert pod["spec"]["nodeName"] == "node-1"
    # Three pods of 20 units on three 29-unit cards: one card each.
    assert len({card_of(cluster, "node-1", f"ext-big-{i}") for i in range(3)}) == 3


def test_the_profile_leaves_pending_what_no_card_holds(
    cluster: Cluster, gpushare_scheduler: str, pods: list[str]
) -> None:
    name = "ext-no-card"
    pods.append(name)
    cluster.create_pod(pod_manifest(name, {MEMORY: 20}, node="node-2", scheduler=PROFILE))
    condition = cluster.wait_scheduling_refused("default", name)
    assert condition["reason"] == "Unschedulable", condition
    pod = cluster.pod("default", name)
    assert pod is not None and not pod["spec"].get("nodeName")
    assert pod["status"]["phase"] == "Pending"


def test_the_sample_configuration_in_place_of_the_stock_scheduler(
    cluster: Cluster, extender: None, pods: list[str]
) -> None:
    cluster.start_scheduler(sample_config())
    try:
        name = "ext-sample-no-card"
        pods.append(name)
        cluster.create_pod(pod_manifest(name, {MEMORY: 20}, node="node-2"))
        condition = cluster.wait_scheduling_refused("default", name)
        assert condition["reason"] == "Unschedulable", condition
        fits = "ext-sample-fits"
        pods.append(fits)
        cluster.create_pod(pod_manifest(fits, {MEMORY: 12, CORE: 10}, node="node-2"))
        pod = cluster.wait_pod("default", fits, "Running")
        assert pod["spec"]["nodeName"] == "node-2"
        card_of(cluster, "node-2", fits)
    finally:
        cluster.start_scheduler()
