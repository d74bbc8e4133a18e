"""DRA shares beside device-plugin shares: what the DRA driver prepared on its cards is in
the Node annotation, in ``kubectl gpushare inspect`` and in ``/metrics``.

The daemon runs on a simulated node of three Tesla P4 (card 0 shared by the device
plugin, cards 1 and 2 in card mode ``dra``) against the API-server double; the DRA
stand-in kubelet prepares claims over the plugin's socket, the device-plugin stand-in
admits a container; inspect is built by the command's own functions from the double's
Node and Pod objects, the metrics are scraped over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import NODE, TESLA_P4, Node, cards, gpu_uuid
from kit import promlint
from kit.kube_double import KubeApiDouble
from kit.procs import free_port, metric_samples, scrape
from test_node_api import add_pod, eventually, node_annotation

from gpushare.daemon import Daemon
from gpushare.kube import nodestate
from gpushare.kube.kubectlapi import Cluster
from gpushare.ops import inspect
from gpushare.ops.daemonmetrics import RENAMED
from gpushare.sim.drakubeletdouble import DraKubelet, allocated_claim, pod_using_claims

PREFIX = "gpushare.io"
DRIVER = "gpu.gpushare.io"
MIB = 1 << 20
#: A Tesla P4 (7611 MiB) as a DRA card publishes it: 29 units of 256 MiB.
P4_PUBLISHED = 7424


def dra_cards(state: nodestate.NodeGpuState | None) -> dict[str, nodestate.WholeCardState]:
    if state is None:
        return {}
    return {c.uuid: c for c in state.whole if c.mode == nodestate.DRA_MODE}


def claims_of(state: nodestate.NodeGpuState | None) -> dict[str, set[tuple[Any, ...]]]:
    """Card UUID -> (namespace, claim, request, device, memory MiB, cores) of each claim."""
    return {
        uuid: {
            (c.namespace, c.claim, c.request, c.device, c.memory_mib, c.cores) for c in card.claims
        }
        for uuid, card in dra_cards(state).items()
    }


def samples(port: int, name: str) -> list[dict[str, Any]]:
    status, text = scrape(port)
    assert status == 200
    return metric_samples(text, name)


def per_card(port: int, name: str) -> dict[str, float]:
    return {s["gpu"]: s["value"] for s in samples(port, name)}


def per_claim(port: int, name: str) -> dict[tuple[str, str, str], float]:
    return {(s["namespace"], s["claim"], s["gpu"]): s["value"] for s in samples(port, name)}


class DraDaemon:
    """The node's daemon with cards 1 and 2 in card mode dra, and the DRA kubelet."""

    def __init__(self, node: Node, api: KubeApiDouble) -> None:
        self.node, self.api = node, api
        self.port = free_port()
        node.with_pod_specs()
        node.start(
            cards(TESLA_P4, 3),
            card_modes="1=dra,2=dra",
            node_name=NODE,
            dra_kubelet_root=str(node.root / "kubelet"),
            dra_cdi_dir=str(node.root / "cdi"),
            dra_resync_seconds=0.05,
            metrics_port=self.port,
            metrics_address="127.0.0.1",
        )
        self.kubelet = DraKubelet(node.root / "kubelet")
        self.kubelet.register()

    def claim(self, namespace: str, name: str, device: str, **capacity: str) -> tuple[str, ...]:
        result: dict[str, Any] = {"request": "gpu", "device": device}
        if capacity:
            result["consumedCapacity"] = capacity
        obj = self.api.add(allocated_claim(namespace, name, DRIVER, NODE, [result]))
        return (namespace, name, obj["metadata"]["uid"])

    def restart(self) -> None:
        node = self.node
        assert node.daemon is not None
        self.kubelet.close()
        node.daemon.stop()
        # the Node as the new daemon finds it: nothing published (what it shows is its own)
        self.api.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {}}})
        node.daemon = Daemon(node.settings, specs=node.specs)
        node.daemon.start()
        self.kubelet = DraKubelet(node.root / "kubelet")
        self.kubelet.register()


@pytest.fixture
def dra(node: Node, api: KubeApiDouble) -> Iterator[DraDaemon]:
    daemon = DraDaemon(node, api)
    try:
        yield daemon
    finally:
        daemon.kubelet.close()


def test_dra_claims_are_published_inspected_and_exported_beside_device_plugin_shares(
    dra: DraDaemon, node: Node, api: KubeApiDouble
) -> None:
    one, two = gpu_uuid(1), gpu_uuid(2)
    state = eventually(
        lambda: node_annotation(api) if len(dra_cards(node_annotation(api))) == 2 else None
    )
    assert [c.uuid for c in state.cards] == [gpu_uuid(0)]  # the extender's list: shared only
    assert claims_of(state) == {one: set(), two: set()}
    # a device-plugin share on card 0, three DRA claims on cards 1 and 2
    add_pod(api, node, "dp", {node.memory: 8, node.core: 20})
    node.kubelet.admit("dp", "main", {node.memory: 8, node.core: 20})
    refs = [
        dra.claim("ml", "small", "gpu-1", memory="1024Mi", cores="30"),  # 1000Mi as charged
        dra.claim("ml", "memory-only", "gpu-1", memory="2Gi"),
        dra.claim("batch", "whole", "gpu-2"),  # no sizes: the whole card, unthrottled
    ]
    answers = dra.kubelet.prepare(refs)
    assert all(a.error == "" for a in answers.values())

    expected = {
        one: {
            ("ml", "small", "gpu", "gpu-1", 1024, 30),
            ("ml", "memory-only", "gpu", "gpu-1", 2048, 0),
        },
        two: {("batch", "whole", "gpu", "gpu-2", P4_PUBLISHED, 0)},
    }
    state = eventually(lambda: s if claims_of(s := node_annotation(api)) == expected else None)
    figures = {
        u: (c.claim_count, c.memory_used_mib, c.cores_used) for u, c in dra_cards(state).items()
    }
    assert figures == {one: (2, 3072, 30), two: (1, P4_PUBLISHED, 0)}
    eventually(lambda: (s := node_annotation(api)) and s.cards[0].memory_units_used == 8)
    # the daemon annotates the pod with its card after it publishes the count: inspect
    # shows the share only once both agree
    card_key = nodestate.pod_annotation_key(PREFIX, "main")
    eventually(
        lambda: (
            (api.get("Pod", "dp", "default") or {})
            .get("metadata", {})
            .get("annotations", {})
            .get(card_key)
        )
    )

    # inspect, from the double's Node and Pod objects
    view = inspect.build_view(*inspect.fetch(None, Cluster()), PREFIX)
    data = json.loads(inspect.render_json(view))
    (ours,) = data["nodes"]
    assert ours["cardCount"] == 3
    by_uuid = {w["uuid"]: w for w in ours["wholeGpus"]}
    assert by_uuid[one]["mode"] == "dra"
    assert (by_uuid[one]["memoryUsedMib"], by_uuid[one]["memoryTotalMib"]) == (3072, P4_PUBLISHED)
    assert (by_uuid[one]["coreUnitsUsed"], by_uuid[one]["coreUnits"]) == (30, 100)
    assert {
        (c["namespace"], c["claim"], c["memoryMib"], c["cores"]) for c in by_uuid[one]["claims"]
    } == {
        ("ml", "small", 1024, 30),
        ("ml", "memory-only", 2048, 0),
    }
    assert data["totals"]["memoryMib"] == 3 * P4_PUBLISHED
    assert data["totals"]["memoryUsedMib"] == 8 * 256 + 3072 + P4_PUBLISHED
    assert (data["totals"]["coreUnits"], data["totals"]["coreUnitsUsed"]) == (300, 50)
    table = inspect.render_table(view, details=True)
    row = next(line for line in table.splitlines() if line.strip().startswith("1 "))
    assert row.split()[3:8] == ["3072/7424", "(41.4", "%)", "DRA", "30/100"]
    assert "claim ml/small (gpu)" in table and "claim batch/whole (gpu)" in table
    assert "default/dp/main" in table  # the device-plugin share beside them
    assert "claim" not in inspect.render_table(view)  # claims are listed with -d only

    # metrics
    port = dra.port
    assert per_card(port, "gpushare_dra_claims") == {one: 2, two: 1}
    assert per_card(port, "gpushare_dra_memory_allocated_bytes") == {
        one: 3072 * MIB,
        two: P4_PUBLISHED * MIB,
    }
    assert per_card(port, "gpushare_dra_memory_capacity_bytes") == {
        one: P4_PUBLISHED * MIB,
        two: P4_PUBLISHED * MIB,
    }
    assert per_card(port, "gpushare_dra_cores_allocated") == {one: 30, two: 0}
    # Prometheus' naming rules hold for the DRA families too (issue 33.5); the renamed
    # ones are also served under their old names, marked deprecated
    text = scrape(port)[1]
    assert promlint.problems(text, deprecated=RENAMED.values()) == []
    assert "# HELP gpushare_dra_memory_bytes_total DEPRECATED: use " in text
    assert per_claim(port, "gpushare_dra_claim_memory_bytes") == {
        ("ml", "small", one): 1024 * MIB,
        ("ml", "memory-only", one): 2048 * MIB,
        ("batch", "whole", two): P4_PUBLISHED * MIB,
    }
    assert per_claim(port, "gpushare_dra_claim_cores") == {("ml", "small", one): 30}
    assert set(per_card(port, "gpushare_memory_allocated_bytes")) == {gpu_uuid(0)}

    # unprepared: gone from all three
    assert dra.kubelet.unprepare([refs[0], refs[2]]) == {refs[0][2]: "", refs[2][2]: ""}
    left = {one: {("ml", "memory-only", "gpu", "gpu-1", 2048, 0)}, two: set()}
    eventually(lambda: claims_of(node_annotation(api)) == left)
    assert per_card(port, "gpushare_dra_claims") == {one: 1, two: 0}
    assert per_claim(port, "gpushare_dra_claim_memory_bytes") == {
        ("ml", "memory-only", one): 2048 * MIB
    }
    view = inspect.build_view(*inspect.fetch(None, Cluster()), PREFIX)
    assert "small" not in inspect.render_table(view, details=True)

    # a restarted daemon shows them again, from its checkpoint, on a Node that lost them
    dra.restart()
    eventually(lambda: claims_of(node_annotation(api)) == left)
    assert per_claim(port, "gpushare_dra_claim_memory_bytes") == {
        ("ml", "memory-only", one): 2048 * MIB
    }
    assert dra.kubelet.unprepare([refs[1]]) == {refs[1][2]: ""}
    eventually(lambda: claims_of(node_annotation(api)) == {one: set(), two: set()})
    assert per_card(port, "gpushare_dra_memory_allocated_bytes") == {one: 0, two: 0}


def test_the_daemon_takes_a_reserving_pod_from_its_pod_watch(
    dra: DraDaemon, node: Node, api: KubeApiDouble
) -> None:
    """The daemon's own pod watch feeds the DRA driver: a pod whose container uses two
    claims is not read at prepare once the watch holds it, and both claims are held to
    the smaller share."""
    pod = api.add(pod_using_claims("ml", "both", NODE, {"main": ["small", "large"]}))
    uid = pod["metadata"]["uid"]
    assert node.daemon is not None and node.daemon.core is not None
    link = node.daemon.core.api_link
    assert link is not None
    eventually(lambda: link.pods.claim_pod(uid))
    refs = []
    for name, device, memory in (("small", "gpu-1", "1Gi"), ("large", "gpu-2", "4Gi")):
        claim = allocated_claim(
            "ml",
            name,
            DRIVER,
            NODE,
            [{"request": "gpu", "device": device, "consumedCapacity": {"memory": memory}}],
            reserved_for=[("both", uid)],
        )
        refs.append(("ml", name, api.add(claim)["metadata"]["uid"]))
    answers = dra.kubelet.prepare(refs)
    assert [a.error for a in answers.values()] == ["", ""]
    assert api.calls("GET", "/namespaces/ml/pods/") == []
    for ref in refs:
        spec = json.loads((node.root / "cdi" / f"{DRIVER}-claim_{ref[2]}.json").read_text())
        env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
        assert env["CUDA_DEVICE_MEMORY_LIMIT"] == "1024m"
