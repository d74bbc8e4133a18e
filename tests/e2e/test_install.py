"""`kubectl gpushare install` and `uninstall` against a real API server, on a cluster of its
own with nothing of gpushare in it: install applies the RBAC and the DaemonSet and labels the
node, the real DaemonSet controller puts the pod on it and the real kubelet starts it (on the
CRI fake); the daemon, run as that pod's container, registers; uninstall unlabels the node, the
controller takes the pod away, and everything install created goes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from e2e_nodes import CARD_4GIB, cards
from kube_cluster import MEMORY, REPO, Cluster, NodeSpec, running_cluster, wait_for

NODE = "node-1"
DS = "/apis/apps/v1/namespaces/kube-system/daemonsets/gpushare"
OPT_IN = "gpushare.io/enabled"
STATE = f"/api/v1/namespaces/kube-system/configmaps/gpushare-node-{NODE}"


@pytest.fixture(scope="module")
def bare() -> Iterator[Cluster]:
    """A second cluster: one node with two cards, no label, no gpushare objects."""
    spec = NodeSpec(NODE, cards(7, CARD_4GIB, 2), labels={})
    with running_cluster(
        [spec], logs=REPO / "e2e" / "logs" / "install-cluster", install=False
    ) as c:
        yield c


def daemonset_pods(cluster: Cluster) -> list[dict[str, Any]]:
    pods = cluster.api.get("/api/v1/namespaces/kube-system/pods")["items"]
    return [
        p
        for p in pods
        if any(o.get("kind") == "DaemonSet" for o in p["metadata"].get("ownerReferences", []))
    ]


def test_install_then_uninstall(bare: Cluster) -> None:
    assert bare.api.get_or_none(DS) is None
    reply = bare.kubectl_gpushare("install", "--node", NODE)
    assert reply.returncode == 0, reply.stdout + reply.stderr
    assert bare.api.get_or_none(DS) is not None
    assert bare.node(NODE)["metadata"]["labels"].get(OPT_IN) == "true"

    # The controller creates the pod with node affinity; the scheduler then binds it.
    (pod,) = wait_for(
        "the DaemonSet's pod bound to the node",
        lambda: [p for p in daemonset_pods(bare) if p["spec"].get("nodeName")],
        60,
    )
    name = pod["metadata"]["name"]
    assert pod["spec"]["nodeName"] == NODE
    bare.wait_pod("kube-system", name, "Running")
    record = bare.wait_record(NODE, "kube-system", name, "gpushare")
    assert record["env"]["NODE_NAME"] == NODE  # the kubelet's downward API
    assert record["env"]["POD_NAMESPACE"] == "kube-system"
    assert record["command"] == ["gpushare-device-plugin"]

    agent = bare.nodes[NODE]
    agent.daemon_pod = name
    agent.start_daemon()  # waits for the node's allocatable
    assert int(bare.allocatable(NODE)[MEMORY]) == 32
    # the node's state object, written with the RBAC install applied (a Role)
    wait_for("the node's state object", lambda: bare.api.get_or_none(STATE), 60)

    # --keep-host: the host cleanup pod needs a real runtime (the CRI fake never ends its
    # container); test_uninstall_real.py runs it on containerd and runc
    uninstall = bare.kubectl_gpushare("uninstall", "--all", "--wait", "0", "--keep-host")
    assert uninstall.returncode == 0, uninstall.stdout + uninstall.stderr
    assert OPT_IN not in bare.node(NODE)["metadata"].get("labels", {})
    # The controller takes the pod off the unlabelled node; its container (our daemon) ends.
    wait_for("the DaemonSet's pod to go", lambda: not daemonset_pods(bare), 90)
    agent.stop_daemon()
    # Run again once the pod has gone: now nothing keeps what install created.
    again = bare.kubectl_gpushare("uninstall", "--all", "--wait", "0", "--keep-host")
    assert again.returncode == 0, again.stdout + again.stderr
    wait_for("the DaemonSet to be deleted", lambda: bare.api.get_or_none(DS) is None, 60)
    for path in (
        "/api/v1/namespaces/kube-system/serviceaccounts/gpushare",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles/gpushare",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/gpushare",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/roles/gpushare",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/rolebindings/gpushare",
        STATE,  # deleted by uninstall once the daemon's pod had gone
    ):
        assert bare.api.get_or_none(path) is None, path
