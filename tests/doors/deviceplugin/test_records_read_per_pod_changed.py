"""Every GetPreferredAllocation reads the kubelet's PodResources records (pairing and the
pod specs need them fresh), and the kubelet lists one entry per device: a node of H200s
answers with thousands. Each read decodes only the pods whose entry changed since the
last one, so admitting a container costs a bounded number of decodes however many
devices the node's other containers hold; and the containers still pair (memory and
core units on one card)."""

from __future__ import annotations

from conftest import H200, Node, cards


def test_each_admission_decodes_only_its_own_pod_on_a_full_node(node: Node) -> None:
    node.with_pod_specs()
    daemon = node.start(cards(H200, 2), pod_resources_interval_seconds=3600)
    assert daemon.core is not None
    records = daemon.core.pod_resources
    need = {node.memory: 60, node.core: 10}  # 15 GiB: 9 such containers fill a card's memory

    def admit(name: str, i: int) -> None:
        node.pod(name, need)
        order = [node.core, node.memory] if i % 2 else [node.memory, node.core]
        admitted = node.kubelet.admit(name, "main", need, order=order)
        assert {d.rpartition("::")[0] for ids in admitted.devices.values() for d in ids} == {
            admitted.card()
        }

    for i in range(14):
        admit(f"held-{i}", i)
    listed = sum(
        len(c.devices) for p in node.kubelet.list_response().pod_resources for c in p.containers
    )
    assert listed == 14 * 70  # one entry per device
    before, reads_before = records.decoded, node.kubelet.lists_served
    for i in range(4):
        admit(f"new-{i}", i)
    reads = node.kubelet.lists_served - reads_before
    assert reads >= 8  # each of the 8 GetPreferredAllocation calls read the records
    # A new pod's entry has two versions (one resource held, then both); the 14 pods
    # holding 980 entries are never decoded again.
    assert records.decoded - before <= 2 * 4
