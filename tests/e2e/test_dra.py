"""The DRA driver (docs/dra.md) on the real cluster: the driver in the daemon, the real
scheduler's allocator and the real kubelet's DRA manager (plugin watcher,
NodePrepareResources, its claim checkpoint).

Two nodes are added with three Tesla P4 each (29 units of 256 MiB: 7424 MiB published per
card): card 0 stays with the device plugin, cards 1 and 2 are in card mode ``dra``. The
daemon runs with its ServiceAccount token and the RBAC of ``daemonset/dra/``; claims use the
DeviceClass of ``daemonset/dra/deviceclasses.yaml``.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_nodes import TESLA_P4, cards
from kube_cluster import (
    CORE,
    MEMORY,
    REPO,
    WHOLE,
    Cluster,
    E2EError,
    NodeSpec,
    load_manifests,
    pod_manifest,
    wait_for,
)

DRIVER = "gpu.gpushare.io"
RESOURCE = "/apis/resource.k8s.io/v1"
DRA_NODES = ("node-3", "node-4")
CARD_MIB = 29 * 256  # a Tesla P4 (7611 MiB) rounded down to the unit


def cdi_dir(cluster: Cluster, node: str) -> Path:
    return cluster.dir / node / "cdi"


@pytest.fixture(scope="module")
def dra_nodes(cluster: Cluster) -> Iterator[list[str]]:
    cluster.api.apply_all(load_manifests(REPO / "daemonset" / "dra" / "rbac.yaml"))
    cluster.api.apply_all(load_manifests(REPO / "daemonset" / "dra" / "deviceclasses.yaml"))
    for number, name in enumerate(DRA_NODES, start=3):
        cluster.add_node(
            NodeSpec(
                name,
                cards(number, TESLA_P4, 3),
                daemon_args=[
                    "--card-modes=1=dra,2=dra",
                    f"--dra-cdi-dir={cdi_dir(cluster, name)}",
                    "--dra-resync-seconds=1",
                ],
            )
        )
    for name in DRA_NODES:
        wait_for(f"{name}'s slice", lambda name=name: published(cluster, name), 60)
    try:
        yield list(DRA_NODES)
    finally:
        for name in DRA_NODES:
            cluster.remove_node(name)
            cluster.api.delete(f"{RESOURCE}/resourceslices", fieldSelector=f"spec.nodeName={name}")
        for obj in load_manifests(REPO / "daemonset" / "dra" / "deviceclasses.yaml"):
            cluster.api.delete(cluster.api.path(obj))


def published(cluster: Cluster, node: str) -> list[str]:
    items = cluster.api.get(f"{RESOURCE}/resourceslices", fieldSelector=f"spec.nodeName={node}")[
        "items"
    ]
    return sorted(d["name"] for s in items for d in s["spec"].get("devices", []))


def generation(cluster: Cluster, node: str) -> int:
    items = cluster.api.get(f"{RESOURCE}/resourceslices", fieldSelector=f"spec.nodeName={node}")[
        "items"
    ]
    return max((s["spec"]["pool"]["generation"] for s in items), default=0)


def claim_pod(name: str, requests: dict[str, str] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ResourceClaimTemplate asking one share (memory and cores in ONE request) and a pod
    of one pause container using it."""
    exactly: dict[str, Any] = {"deviceClassName": "gpushare.io"}
    if requests:
        exactly["capacity"] = {"requests": requests}
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": name}],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "tolerations": [{"operator": "Exists"}],
        },
    }
    return template, pod


class Workload:
    """Pods with claims this module created, removed at the end."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.names: list[str] = []

    def create(self, name: str, requests: dict[str, str] | None) -> None:
        template, pod = claim_pod(name, requests)
        reply = self.cluster.api.create(template)
        assert reply.status_code == 201, reply.text[:400]
        self.cluster.create_pod(pod)
        self.names.append(name)

    def claim(self, pod: str) -> dict[str, Any] | None:
        found = self.cluster.pod("default", pod)
        statuses = (found or {}).get("status", {}).get("resourceClaimStatuses") or []
        if not statuses or not statuses[0].get("resourceClaimName"):
            return None
        return self.cluster.api.get_or_none(
            f"{RESOURCE}/namespaces/default/resourceclaims/{statuses[0]['resourceClaimName']}"
        )

    def cleanup(self) -> None:
        for name in self.names:
            self.cluster.delete_pod("default", name, wait=False)
        for name in self.names:
            self.cluster.delete_pod("default", name)
            self.cluster.api.delete(f"{RESOURCE}/namespaces/default/resourceclaimtemplates/{name}")
        self.names.clear()


@pytest.fixture
def workload(cluster: Cluster, dra_nodes: list[str]) -> Iterator[Workload]:
    w = Workload(cluster)
    try:
        yield w
    finally:
        w.cleanup()


def spec_env(cluster: Cluster, node: str, claim: dict[str, Any]) -> dict[str, str]:
    uid = claim["metadata"]["uid"]
    spec = json.loads((cdi_dir(cluster, node) / f"{DRIVER}-claim_{uid}.json").read_text())
    (device,) = spec["devices"]
    return dict(e.split("=", 1) for e in device["containerEdits"]["env"])


def mib(quantity: str) -> int:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity) // (1 << 20)


def random_sizes() -> list[tuple[int, int]]:
    """(memory MiB, cores) of the random workload, the same for DRA and the device plugin."""
    rng = random.Random(2022)
    return [
        (
            rng.choice([256, 700, 1024, 2048, 3000, 4096, 6000, 7424]),
            rng.choice([0, 0, 10, 25, 40, 60]),
        )
        for _ in range(14)
    ]


#: Pods of 18 units (4608 MiB), no cores: one fits a card (29 units), two fit a node's two
#: cards by their sum (58), so a scheduler that sees only the node's total places three.
FRAGMENTING = [(4608, 0)] * 6
#: The workloads compared in docs/dra.md, by name: (memory MiB, cores) per pod.
WORKLOADS = {"random": random_sizes(), "fragmenting": FRAGMENTING}
#: Pods that could not run, by (workload, front door): "dra" or "device plugin".
REFUSED: dict[tuple[str, str], str] = {}


#: PodScheduled False for a claim the scheduler could not see yet: the resourceclaim
#: controller has not made it ("ResourceClaim not created yet"), or the scheduler's informer
#: has not got it ("... not found"). The pod is tried again once it has; not a refusal.
CLAIM_NOT_SEEN = ("not created yet", "not found")


def settled(cluster: Cluster, names: list[str]) -> dict[str, dict[str, Any]] | None:
    """Every pod Running, refused by the scheduler, or failed by the kubelet's admission."""
    pods = {n: cluster.pod("default", n) or {} for n in names}
    for pod in pods.values():
        status = pod.get("status", {})
        if status.get("phase") in ("Running", "Failed"):
            continue
        if any(
            c["type"] == "PodScheduled"
            and c["status"] == "False"
            and not any(word in c.get("message", "") for word in CLAIM_NOT_SEEN)
            for c in status.get("conditions", [])
        ):
            continue
        return None
    return pods


def test_random_shares_land_on_one_card_never_overcommitted(
    cluster: Cluster, workload: Workload
) -> None:
    asked: dict[str, tuple[int, int]] = {}
    for i, (memory, cores) in enumerate(random_sizes()):
        asked[f"dra-r{i}"] = (memory, cores)
        requests = {"memory": f"{memory}Mi"} | ({"cores": str(cores)} if cores else {})
        workload.create(f"dra-r{i}", requests)

    pods = wait_for(
        "every pod Running or unschedulable", lambda: settled(cluster, list(asked)), 180, step=0.5
    )
    used: dict[tuple[str, str], list[int]] = {}
    claims: dict[tuple[str, str], set[tuple[str, str, int, int]]] = {
        (n, d): set() for n in DRA_NODES for d in ("gpu-1", "gpu-2")
    }
    running = 0
    for name, (memory, cores) in asked.items():
        if pods[name]["status"].get("phase") != "Running":
            continue
        running += 1
        node = pods[name]["spec"]["nodeName"]
        claim = workload.claim(name)
        assert claim is not None
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == (DRIVER, node)
        charged = mib(result["consumedCapacity"]["memory"])
        assert charged == 256 * math.ceil(memory / 256)
        totals = used.setdefault((node, result["device"]), [0, 0])
        totals[0] += charged
        totals[1] += cores
        claims[(node, result["device"])].add(("default", claim["metadata"]["name"], charged, cores))
        # what the runtime was told: our CDI device, whose edits carry the rounded limits
        record = cluster.wait_record(node, "default", name, "main")
        ours = f"{DRIVER}/claim={claim['metadata']['uid']}-gpu-{result['device']}"
        assert ours in str(record["cdi_devices"]), record["cdi_devices"]
        env = spec_env(cluster, node, claim)
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{charged}m"
        assert env.get("CUDA_DEVICE_SM_LIMIT", "0") == str(cores)
    for key, (memory, cores) in used.items():
        assert memory <= CARD_MIB and cores <= 100, (key, memory, cores)
    for name, (memory, cores) in asked.items():
        if pods[name]["status"].get("phase") == "Running":
            continue
        need = 256 * math.ceil(memory / 256)
        free = [
            (CARD_MIB - used.get((n, d), [0, 0])[0], 100 - used.get((n, d), [0, 0])[1])
            for n in DRA_NODES
            for d in ("gpu-1", "gpu-2")
        ]
        assert not any(m >= need and c >= cores for m, c in free), (name, asked[name], free)
    assert running >= 4
    # kubectl gpushare inspect (the Node annotation) lists each running pod's claim on the
    # card the allocator chose, with the rounded sizes, and the cards' sums
    expected = {key: (found, *used.get(key, [0, 0])) for key, found in claims.items()}
    try:
        # a kubectl-gpushare process per try, on a loaded machine: a generous deadline
        wait_for("inspect shows the claims", lambda: inspected_claims(cluster) == expected, 90)
    except E2EError:
        assert inspected_claims(cluster) == expected  # the difference, shown
        raise
    REFUSED[("random", "dra")] = f"{len(asked) - running} of {len(asked)} unschedulable"
    print(f"dra e2e: {running} of {len(asked)} running; per card (MiB, cores): {used}")


def inspected_claims(
    cluster: Cluster,
) -> dict[tuple[str, str], tuple[set[tuple[str, str, int, int]], int, int]] | None:
    """(node, device) -> the claims ``kubectl gpushare inspect -o json`` lists on each DRA
    card of the DRA nodes (namespace, claim, MiB, cores), the card's MiB and cores used."""
    reply = cluster.kubectl_gpushare("inspect", "-o", "json")
    if reply.returncode != 0:
        return None
    shown = {}
    for node in json.loads(reply.stdout)["nodes"]:
        if node["name"] not in DRA_NODES:
            continue
        for card in node["wholeGpus"]:
            if card.get("mode") != "dra":
                continue
            assert card["memoryTotalMib"] == CARD_MIB and not card["claimsTruncated"]
            listed = {
                (c["namespace"], c["claim"], c["memoryMib"], c["cores"]) for c in card["claims"]
            }
            shown[(node["name"], f"gpu-{card['index']}")] = (
                listed,
                card["memoryUsedMib"],
                card["coreUnitsUsed"],
            )
    return shown


def test_fragmenting_shares_wait_for_a_card_instead_of_failing(
    cluster: Cluster, workload: Workload
) -> None:
    """Six shares of 18 units on four cards of 29: four run, one per card; the other two
    stay Pending (unschedulable, placed as soon as a card frees), none fails admission."""
    names = [f"dra-f{i}" for i in range(len(FRAGMENTING))]
    for name, (memory, _cores) in zip(names, FRAGMENTING, strict=True):
        workload.create(name, {"memory": f"{memory}Mi"})
    pods = wait_for(
        "every pod Running or unschedulable", lambda: settled(cluster, names), 180, step=0.5
    )
    phases = sorted(p["status"].get("phase", "") for p in pods.values())
    assert phases == ["Pending"] * 2 + ["Running"] * 4, phases
    devices = set()
    for name in names:
        if pods[name]["status"].get("phase") == "Running":
            claim = workload.claim(name)
            assert claim is not None
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            devices.add((result["pool"], result["device"]))
    assert len(devices) == 4  # one share per card: none holds two
    REFUSED[("fragmenting", "dra")] = "2 of 6 unschedulable, 0 failed admission"
    # a freed card takes a waiting pod: the allocator places it, the kubelet prepares it
    running = next(n for n in names if pods[n]["status"].get("phase") == "Running")
    cluster.delete_pod("default", running)

    def running_now() -> int:
        phases = [(cluster.pod("default", n) or {}).get("status", {}).get("phase") for n in names]
        return phases.count("Running")

    wait_for("a waiting pod Running on the freed card", lambda: running_now() == 4, 120, step=0.5)


def test_daemon_killed_between_prepare_and_unprepare(cluster: Cluster, workload: Workload) -> None:
    workload.create("dra-kill", {"memory": "1Gi", "cores": "20"})
    pod = cluster.wait_pod("default", "dra-kill", "Running", timeout=120)
    node = pod["spec"]["nodeName"]
    claim = workload.claim("dra-kill")
    assert claim is not None
    spec = cdi_dir(cluster, node) / f"{DRIVER}-claim_{claim['metadata']['uid']}.json"
    assert spec.exists()
    agent = cluster.nodes[node]
    agent.kill_daemon()
    cluster.delete_pod("default", "dra-kill", wait=False)
    workload.names.remove("dra-kill")
    agent.start_daemon()
    # the kubelet retries NodeUnprepareResources; the checkpoint knows what to remove
    wait_for("the pod gone", lambda: cluster.pod("default", "dra-kill") is None, 120, step=0.5)
    wait_for("the claim's CDI spec removed", lambda: not spec.exists(), 60)
    cluster.api.delete(f"{RESOURCE}/namespaces/default/resourceclaimtemplates/dra-kill")


def test_kubelet_restart_republishes_and_keeps_prepared_claims(
    cluster: Cluster, workload: Workload
) -> None:
    workload.create("dra-keep", {"memory": "2Gi"})
    pod = cluster.wait_pod("default", "dra-keep", "Running", timeout=120)
    node = pod["spec"]["nodeName"]
    before = generation(cluster, node)
    agent = cluster.nodes[node]
    agent.restart_kubelet()
    cluster.wait_node_ready(node)
    # the kubelet deletes the node's slices as it starts: the daemon publishes them again
    # (a pass that raced the kubelet's deletion may be wiped and published once more)
    wait_for(
        f"{node}'s slice re-published",
        lambda: generation(cluster, node) > before and published(cluster, node),
        60,
    )
    assert published(cluster, node) == ["gpu-1", "gpu-2"]
    assert (cluster.pod("default", "dra-keep") or {}).get("status", {}).get("phase") == "Running"
    workload.create("dra-after", {"memory": "1Gi", "cores": "10"})
    cluster.wait_pod("default", "dra-after", "Running", timeout=120)


def test_an_unchanged_whole_card_pod_lands_on_a_dra_card(
    cluster: Cluster, dra_nodes: list[str]
) -> None:
    """KEP-5004: `gpushare.io/gpu: 1` on nodes whose device plugin does not offer it is
    served by the DeviceClass with extendedResourceName: the scheduler charges the
    capacities' defaults (the whole memory, no cores), so the pod gets a whole DRA card."""
    cluster.create_pod(pod_manifest("dra-whole", {WHOLE: 1}))
    try:
        try:
            pod = cluster.wait_pod("default", "dra-whole", "Running", timeout=120)
        except AssertionError as exc:
            status = (cluster.pod("default", "dra-whole") or {}).get("status")
            raise AssertionError(f"{exc}; pod status: {status}") from None
        node = pod["spec"]["nodeName"]
        assert node in dra_nodes
        record = cluster.wait_record(node, "default", "dra-whole", "main")
        uids = re.findall(rf"{re.escape(DRIVER)}/claim=([0-9a-f-]{{36}})-", str(record))
        assert len(set(uids)) == 1, record["cdi_devices"]
        spec_file = cdi_dir(cluster, node) / f"{DRIVER}-claim_{uids[0]}.json"
        (device,) = json.loads(spec_file.read_text())["devices"]
        env = dict(e.split("=", 1) for e in device["containerEdits"]["env"])
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{CARD_MIB}m"  # the whole card
        assert "CUDA_DEVICE_SM_LIMIT" not in env
    finally:
        cluster.delete_pod("default", "dra-whole")


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_same_workload_on_device_plugin_cards_for_comparison(
    cluster: Cluster, dra_nodes: list[str], name: str
) -> None:
    """The same sizes as vcuda-memory/vcuda-core pods on the same number of cards, served
    by the device plugin with the stock scheduler and no extender (the yardstick of docs/dra.md)."""
    workload_name = name
    for name in dra_nodes:  # cards 1 and 2 to the device plugin, card 0 to DRA
        cluster.nodes[name].restart_daemon("--card-modes=0=dra")
        cluster.wait_allocatable(name, lambda a: int(a.get(MEMORY, "0")) == 2 * 29)
    names = []
    try:
        for i, (memory, cores) in enumerate(WORKLOADS[workload_name]):
            limits = {MEMORY: math.ceil(memory / 256)} | ({CORE: cores} if cores else {})
            manifest = pod_manifest(f"dp-{workload_name[0]}{i}", limits)
            manifest["spec"]["affinity"] = {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "kubernetes.io/hostname",
                                        "operator": "In",
                                        "values": list(dra_nodes),
                                    }
                                ]
                            }
                        ]
                    }
                }
            }
            cluster.create_pod(manifest)
            names.append(f"dp-{workload_name[0]}{i}")
        pods = wait_for(
            "every device-plugin pod Running, refused or failed",
            lambda: settled(cluster, names),
            180,
            step=0.5,
        )
        failed = sum(1 for p in pods.values() if p["status"].get("phase") == "Failed")
        pending = sum(
            1 for p in pods.values() if p["status"].get("phase") not in ("Running", "Failed")
        )
        REFUSED[(workload_name, "device plugin")] = (
            f"{failed + pending} of {len(names)}: {pending} unschedulable, "
            f"{failed} failed admission"
        )
        print(
            f"{workload_name} workload, not running: DRA {REFUSED.get((workload_name, 'dra'))}; "
            f"device plugin without the extender {REFUSED[(workload_name, 'device plugin')]}"
        )
        # whatever the scheduler did, the device plugin never split a container
        for pod in pods.values():
            if pod["status"].get("phase") == "Running":
                record = cluster.wait_record(
                    pod["spec"]["nodeName"], "default", pod["metadata"]["name"], "main"
                )
                assert "," not in record["env"]["NVIDIA_VISIBLE_DEVICES"], record["env"]
    finally:
        for name in names:
            cluster.delete_pod("default", name, wait=False)
        for name in names:
            cluster.delete_pod("default", name)
        for name in dra_nodes:
            cluster.nodes[name].restart_daemon()
            wait_for(
                f"{name}'s DRA cards published again",
                lambda name=name: published(cluster, name) == ["gpu-1", "gpu-2"],
                60,
            )
            # ...and the Node's allocatable back to card 0 alone: the next comparison's
            # wait for 2 cards must see its own daemon's registration, not this one's
            # stale figure (seen: every pod refused "no healthy devices present").
            cluster.wait_allocatable(name, lambda a: int(a.get(MEMORY, "0")) == 29)


def test_a_mig_card_in_dra_mode_serves_its_mig_devices_by_claim(
    cluster: Cluster, dra_nodes: list[str]
) -> None:
    """A card in MIG mode in card mode ``dra``: its MIG devices are published in the slice
    (one device each, whole) and leave the device plugin's MIG resources; a claim
    selecting a 1g.5gb profile is allocated one by the real scheduler and prepared by
    the real kubelet with that MIG device's UUID."""
    from test_whole_and_mig import MIG_CARD

    name = "node-5"
    mig_card = {**MIG_CARD, "index": 1}
    cluster.add_node(
        NodeSpec(
            name,
            [cards(5, TESLA_P4, 1)[0], mig_card],
            daemon_args=[
                "--card-modes=1=dra",
                "--mig-strategy=mixed",
                f"--dra-cdi-dir={cdi_dir(cluster, name)}",
                "--dra-resync-seconds=1",
            ],
        )
    )
    pod_name = "dra-mig"
    try:
        devices = wait_for(
            f"{name}'s MIG devices published",
            lambda: (found := published(cluster, name)) and len(found) == 4 and found,
            60,
        )
        assert devices == sorted(
            ["gpu-1-mig-2-0", "gpu-1-mig-3-0", "gpu-1-mig-9-0", "gpu-1-mig-10-0"]
        )
        allocatable = cluster.wait_allocatable(name, lambda a: int(a.get(MEMORY, "0")) == 29)
        assert not [r for r in allocatable if "/mig-" in r], allocatable  # none by the plugin
        template, pod = claim_pod(pod_name, None)
        exactly = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
        exactly["selectors"] = [
            {"cel": {"expression": f'device.attributes["{DRIVER}"].profile == "1g.5gb"'}}
        ]
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": name}
        reply = cluster.api.create(template)
        assert reply.status_code == 201, reply.text[:400]
        cluster.create_pod(pod)
        cluster.wait_pod("default", pod_name, "Running")
        statuses = cluster.pod("default", pod_name)["status"]["resourceClaimStatuses"]
        claim = cluster.api.get(
            f"{RESOURCE}/namespaces/default/resourceclaims/{statuses[0]['resourceClaimName']}"
        )
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["device"] in ("gpu-1-mig-9-0", "gpu-1-mig-10-0")
        env = spec_env(cluster, name, claim)
        by_gi = {9: MIG_CARD["instances"][2]["uuid"], 10: MIG_CARD["instances"][3]["uuid"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == by_gi[int(result["device"].split("-")[3])]
        assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in env  # the partition is the limit
        record = cluster.wait_record(name, "default", pod_name, "main")
        assert f"{DRIVER}/claim={claim['metadata']['uid']}" in str(record["cdi_devices"])
    finally:
        cluster.delete_pod("default", pod_name)
        cluster.api.delete(f"{RESOURCE}/namespaces/default/resourceclaimtemplates/{pod_name}")
        cluster.remove_node(name)
        cluster.api.delete(f"{RESOURCE}/resourceslices", fieldSelector=f"spec.nodeName={name}")


def test_two_claims_in_one_container_are_held_to_the_smaller(
    cluster: Cluster, workload: Workload
) -> None:
    """Issue 32 item 2 on a real cluster: the driver finds, from the real pod and its
    generated claims (the resourceclaim controller's names in the pod's status), that
    one container uses both claims, and holds both specs to the smaller share."""
    sizes = {"small": "1Gi", "large": "3Gi"}
    templates = {}
    for part, memory in sizes.items():
        template, _ = claim_pod(f"dra-two-{part}", {"memory": memory})
        templates[part] = template
        reply = cluster.api.create(template)
        assert reply.status_code == 201, reply.text[:400]
    _, pod = claim_pod("dra-two", None)
    pod["spec"]["resourceClaims"] = [
        {"name": part, "resourceClaimTemplateName": f"dra-two-{part}"} for part in sizes
    ]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": part} for part in sizes]
    try:
        cluster.create_pod(pod)
        workload.names.append("dra-two")
        running = cluster.wait_pod("default", "dra-two", "Running", timeout=120)
        statuses = {
            s["name"]: s["resourceClaimName"] for s in running["status"]["resourceClaimStatuses"]
        }
        limits = {}
        for part, claim_name in statuses.items():
            claim = cluster.api.get(f"{RESOURCE}/namespaces/default/resourceclaims/{claim_name}")
            limits[part] = spec_env(cluster, running["spec"]["nodeName"], claim)[
                "CUDA_DEVICE_MEMORY_LIMIT"
            ]
        assert limits == {"small": "1024m", "large": "1024m"}
    finally:
        workload.cleanup()
        for part in sizes:
            cluster.api.delete(
                f"{RESOURCE}/namespaces/default/resourceclaimtemplates/dra-two-{part}"
            )
