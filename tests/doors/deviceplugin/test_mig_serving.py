"""MIG served to the kubelet stand-in over real sockets: the reference document's A100
in mixed (and refused in single), single on uniform MIG devices, a node with a MIG card,
a shared card and a whole card at once, health of MIG devices, pending MIG mode and an
all-MIG node with the strategy none."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import RTX_3090, TESLA_P4, Node, gpu_uuid
from kit.mig_layouts import A100_UUID, mig_uuid, reference_a100, uniform_a100

from gpushare.base.startup import NodeConfigurationError
from gpushare.daemon import Daemon
from gpushare.gpu.mig import MigStrategy, plan
from gpushare.gpu.simulated import SimulatedBackend
from gpushare.sim.kubeletdouble import AdmissionError

PREFIX = "gpushare.io"
MIG_3G, MIG_2G, MIG_1G = (f"{PREFIX}/mig-{p}" for p in ("3g.20gb", "2g.10gb", "1g.5gb"))


def start(node: Node, gpus: list[dict[str, Any]], **overrides: Any) -> Daemon:
    """Start without requiring the shared resources to hold devices (a MIG-only node)."""
    node.write_gpus(gpus)
    node.settings = replace(node.settings, **overrides)
    node.kubelet.start()
    node.daemon = Daemon(node.settings, specs=node.specs)
    node.daemon.start()
    return node.daemon


def registered(node: Node) -> list[str]:
    """The resource names the daemon serves (and registers)."""
    assert node.daemon is not None and node.daemon.plugin.link is not None
    return [name for _server, name in node.daemon.plugin.link.servers]


def counts(node: Node, *resources: str) -> dict[str, int]:
    return {r: node.kubelet.healthy_count(r) for r in resources}


def test_reference_a100_in_mixed_is_three_resources_and_pods_get_their_mig_uuids(
    node: Node,
) -> None:
    start(node, [reference_a100()], mig_strategy="mixed")
    want = {MIG_3G: 1, MIG_2G: 1, MIG_1G: 2}
    assert node.kubelet.wait_for(lambda k: counts(node, *want) == want)
    assert list(node.kubelet.devices(MIG_1G)) == [mig_uuid(2), mig_uuid(3)]
    assert node.kubelet.wait_for(lambda k: node.memory in k.endpoints)
    assert node.kubelet.devices(node.memory) == {}  # the A100 is not sliced
    two = node.kubelet.admit("smi", "nvidia-smi", {MIG_2G: 1})
    assert two.devices[MIG_2G] == [mig_uuid(1)]
    assert two.envs == {"NVIDIA_VISIBLE_DEVICES": mig_uuid(1)}
    assert two.mounts == {}  # no interposer inside a MIG device
    ones = [node.kubelet.admit(f"p{i}", "main", {MIG_1G: 1}) for i in range(2)]
    assert sorted(a.card() for a in ones) == [mig_uuid(2), mig_uuid(3)]
    with pytest.raises(AdmissionError, match=r"Insufficient gpushare\.io/mig-1g\.5gb"):
        node.kubelet.admit("p3", "main", {MIG_1G: 1})
    topology = node.kubelet.devices(MIG_3G)[mig_uuid(0)].topology
    assert [n.ID for n in topology.nodes] == [0]


def test_reference_a100_is_refused_in_single_with_one_line(node: Node) -> None:
    with pytest.raises(NodeConfigurationError) as caught:
        start(node, [reference_a100()], mig_strategy="single")
    assert caught.value.exit_code == 2
    message = str(caught.value)
    assert "\n" not in message and "1g.5gb x2, 2g.10gb x1, 3g.20gb x1" in message
    node.daemon = None


def test_single_serves_uniform_mig_devices_as_gpu_beside_a_shared_card(node: Node) -> None:
    gpus = [uniform_a100(gpu_uuid(0), 0, 0), {"uuid": gpu_uuid(1), **TESLA_P4, "index": 1}]
    start(node, gpus, mig_strategy="single")
    single = f"{PREFIX}/gpu"
    assert node.kubelet.wait_for(lambda k: k.healthy_count(single) == 7)
    assert node.kubelet.wait_for(lambda k: k.healthy_count(node.memory) == 29)
    admitted = node.kubelet.admit("a", "main", {single: 2})
    assert admitted.card() == f"{mig_uuid(0)},{mig_uuid(1)}"
    shared = node.kubelet.admit("b", "main", {node.memory: 4})
    assert shared.card() == gpu_uuid(1)


def test_mixed_node_serves_mig_shared_and_whole_cards_at_once(node: Node) -> None:
    gpus = [
        reference_a100(index=0),
        {"uuid": gpu_uuid(1), **RTX_3090, "index": 1, "numa_node": 1},
        {"uuid": gpu_uuid(2), **TESLA_P4, "index": 2, "numa_node": 0},
    ]
    whole = f"{PREFIX}/gpu"
    start(
        node, gpus, mig_strategy="mixed", whole_cards=True,
        card_modes=f"1=shared,{gpu_uuid(2)}=exclusive",
    )
    assert node.kubelet.wait_for(
        lambda k: counts(node, MIG_3G, MIG_2G, MIG_1G, whole) == {
            MIG_3G: 1, MIG_2G: 1, MIG_1G: 2, whole: 1
        }
        and k.healthy_count(node.memory) == 94
    )
    assert list(node.kubelet.devices(whole)) == [gpu_uuid(2)]
    assert {d.split("::")[0] for d in node.kubelet.devices(node.memory)} == {gpu_uuid(1)}
    shared = node.kubelet.admit("shared", "main", {node.memory: 50, node.core: 30})
    assert shared.card() == gpu_uuid(1)
    assert shared.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{50 * 256}m"
    card = node.kubelet.admit("whole", "main", {whole: 1})
    assert card.card() == gpu_uuid(2)
    instance = node.kubelet.admit("mig", "main", {MIG_3G: 1})
    assert instance.card() == mig_uuid(0)
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in instance.envs


def test_nvidia_names_and_cdi(node: Node) -> None:
    start(
        node,
        [reference_a100()],
        mig_strategy="mixed",
        mig_nvidia_names=True,
        device_list_strategy="envvar,cdi-cri",
    )
    nvidia = "nvidia.com/mig-2g.10gb"
    assert node.kubelet.wait_for(lambda k: k.healthy_count(nvidia) == 1)
    assert MIG_2G not in registered(node)
    admitted = node.kubelet.admit("a", "main", {nvidia: 1})
    response = admitted.responses[nvidia]
    names = [d.name for d in response.cdi_devices]
    assert names[0] == f"nvidia.com/gpu={mig_uuid(1)}"  # the device's own, then ours, last
    assert [n.split("=")[0] for n in names[1:]] == [f"{PREFIX}/grant"]
    assert dict(response.envs) == {}  # sealed in the grant's spec (issue 32)
    assert admitted.devices[nvidia] == [mig_uuid(1)]


def test_a_mig_device_xid_marks_only_that_device_and_a_vanished_one_stays_listed(
    node: Node,
) -> None:
    start(node, [reference_a100()], mig_strategy="mixed", ignored_xids="13")
    want = {MIG_3G: 1, MIG_2G: 1, MIG_1G: 2}
    assert node.kubelet.wait_for(lambda k: counts(node, *want) == want)
    card = reference_a100()
    card["instances"][2]["xid"] = 79  # gi 9: the first 1g.5gb
    node.write_gpus([card])
    assert node.kubelet.wait_for(lambda k: k.healthy_count(MIG_1G) == 1)
    assert node.kubelet.devices(MIG_1G)[mig_uuid(2)].health == "Unhealthy"
    assert counts(node, MIG_3G, MIG_2G) == {MIG_3G: 1, MIG_2G: 1}
    del card["instances"][0]  # the 3g.20gb instance is destroyed
    node.write_gpus([card])
    assert node.kubelet.wait_for(lambda k: k.healthy_count(MIG_3G) == 0)
    assert list(node.kubelet.devices(MIG_3G)) == [mig_uuid(0)]  # listed, not dropped
    card["xid"] = 48  # the whole card: every MIG device
    node.write_gpus([card])
    assert node.kubelet.wait_for(lambda k: sum(counts(node, *want).values()) == 0)


def test_a_changed_mig_layout_is_unhealthy_until_restart(node: Node) -> None:
    start(node, [reference_a100()], mig_strategy="mixed")
    assert node.kubelet.wait_for(lambda k: k.healthy_count(MIG_1G) == 2)
    node.write_gpus([uniform_a100(A100_UUID, 0, 20)])  # repartitioned under us
    assert node.kubelet.wait_for(
        lambda k: sum(counts(node, MIG_3G, MIG_2G, MIG_1G).values()) == 0
    )
    assert node.daemon is not None
    assert "restart gpushare" in node.daemon.core.mig_health.reason(mig_uuid(1))


def test_pending_mig_mode_card_is_not_shared(node: Node) -> None:
    gpus = [
        {"uuid": gpu_uuid(0), **TESLA_P4, "index": 0, "mig_pending": True},
        {"uuid": gpu_uuid(1), **TESLA_P4, "index": 1},
    ]
    node.start(gpus)
    assert {d.split("::")[0] for d in node.kubelet.devices(node.memory)} == {gpu_uuid(1)}


@pytest.mark.parametrize("strategy", ["none", "mixed"])
def test_all_mig_node_says_so_and_stays_not_ready(node: Node, strategy: str) -> None:
    gpus = [{**reference_a100(), "mig_pending": strategy == "mixed"}]
    daemon = start(node, gpus, mig_strategy=strategy)
    assert node.kubelet.wait_for(lambda k: node.memory in k.endpoints)
    assert daemon.plugin.link is not None and daemon.plugin.link.registered.wait(30)
    ready, why = daemon.readiness()
    assert not ready
    assert "every GPU on this node (1) is in MIG mode" in why


def test_mixed_without_mig_cards_changes_nothing(node: Node) -> None:
    node.start([{"uuid": gpu_uuid(0), **TESLA_P4}], mig_strategy="mixed")
    assert node.kubelet.healthy_count(node.memory) == 29
    assert node.daemon is not None and node.daemon.core.found.not_served == ""


def test_the_docs_example_node_file_serves_the_documented_resources(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "modes.md").read_text()
    section = text.split("## MIG", 1)[1]
    blocks = [b.split("```", 1)[0] for b in section.split("```yaml")[1:]]
    (node_file,) = [b for b in blocks if b.lstrip().startswith("gpus:")]
    path = tmp_path / "node.yaml"
    path.write_text(node_file)
    served = plan(SimulatedBackend(path).discover(), MigStrategy.MIXED)
    documented = {
        line.split(":")[0].strip().removeprefix("gpushare.io/"): int(line.split(":")[1])
        for line in section.split("the node offers:", 1)[1].split("```")[1].strip().splitlines()
    }
    assert {name: len(d) for name, d in served.exclusive.items()} == documented


def test_mig_labels_are_published_on_the_node(
    node: Node, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kit.kube_double import KubeApiDouble
    from test_node_api import eventually

    api = KubeApiDouble()
    api.start()
    try:
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(short_tmp / "kubeconfig")))
        api.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {}}})
        gpus = [reference_a100(), {"uuid": gpu_uuid(1), **TESLA_P4, "index": 1}]
        start(node, gpus, mig_strategy="mixed", node_name="n1")
        labels = eventually(lambda: (api.get("Node", "n1") or {})["metadata"]["labels"])
        assert labels[f"{PREFIX}/mig.strategy"] == "mixed"
        assert labels[f"{PREFIX}/mig-1g.5gb.count"] == "2"
        assert labels[f"{PREFIX}/mig-3g.20gb.memory"] == "20096"
        assert labels[f"{PREFIX}/gpu.product"] == "A100-SXM4-40GB"  # the first card, as GFD
        assert labels[f"{PREFIX}/gpu.count"] == "2"  # MIG cards count
    finally:
        node.stop()
        node.daemon = None
        api.stop()


def test_mig_sharing_slices_each_instance_into_memory_units_without_cores(node: Node) -> None:
    start(node, [reference_a100()], mig_strategy="mixed", mig_sharing=True)
    sizes = {mig_uuid(0): 20096 // 256, mig_uuid(1): 9984 // 256,
             mig_uuid(2): 4864 // 256, mig_uuid(3): 4864 // 256}
    assert node.kubelet.wait_for(lambda k: k.healthy_count(node.memory) == sum(sizes.values()))
    ids = list(node.kubelet.devices(node.memory))
    assert {i.split("::")[0] for i in ids} == set(sizes)
    assert f"{mig_uuid(1)}::38" in ids and f"{mig_uuid(1)}::39" not in ids
    assert node.kubelet.wait_for(lambda k: node.core in k.endpoints)
    assert node.kubelet.devices(node.core) == {}  # no vcuda-core on MIG devices
    assert MIG_2G not in registered(node)  # sliced instead of served whole
    admitted = node.kubelet.admit("a", "main", {node.memory: 30})
    assert admitted.card() == mig_uuid(1)  # binpack: the fullest instance that fits
    assert admitted.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{30 * 256}m"
    assert admitted.envs.get("CUDA_DEVICE_SM_LIMIT", "100") == "100"  # not throttled
    assert "LD_PRELOAD" in admitted.envs  # the interposer enforces the memory limit
    with pytest.raises(AdmissionError, match="Insufficient"):
        node.kubelet.admit("b", "main", {node.memory: 1, node.core: 10})
    assert node.daemon is not None and node.daemon.core.found.not_served == ""
    card = reference_a100()
    card["instances"][1]["xid"] = 79  # the instance's XID reaches its units only
    node.write_gpus([card])
    assert node.kubelet.wait_for(
        lambda k: k.healthy_count(node.memory) == sum(sizes.values()) - sizes[mig_uuid(1)]
    )
