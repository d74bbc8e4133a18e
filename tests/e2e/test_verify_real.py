"""`kubectl gpushare verify` on a node with a real runtime and a pod network (issue 39 item 5):
on a node without a GPU it ends in its documented verdict (docs/operations.md, "Verify on
your node"): the probe ran in the container the kubelet, the daemon and containerd set up,
found no driver, and its log, read back through the API server, says so; exit 3 at once, not
after verify's 300 s wait.

A cluster of its own: one node whose kubelet talks to a real containerd and runc
(tests/e2e/real_runtime.py) with a pod network (``NodeSpec.pod_network``: real CNI plugins,
each pod's ``eth0`` a tap device in its own network namespace, e2e/README.md "The pod
network"), its Node given an address the API server reaches its kubelet at (127.0.0.1), and
the gpushare daemon run as in the other e2e nodes (the DaemonSet's pod template, its
process in the node's namespace: its Allocate answers are the same). The gpushare image
(the session's ``gpushare_image``, as `make image-archive` writes it) is imported into the
node's containerd: the probe is the image's own.

Where no probe can run, verify's other exit-3 verdict: here with an ``--image`` that cannot
be pulled (a registry on port 1 of this machine: nothing leaves it), which stays true with
a pod network; test_daemonset_real.py covers the sandbox one (a node with no pod network).
"""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_nodes import CARD_4GIB, cards
from kube_cluster import MEMORY, REPO, Cluster, NodeSpec, running_cluster, wait_for
from local_image import IMAGE
from real_runtime import pod_subnet

NODE = "node-1"
#: the gpushare image's reference in the node's containerd (the archive's tag)
GPUSHARE_IMAGE = "gpushare:0.1.0"
#: an image no registry can serve: the "registry" is port 1 of this machine (refused at
#: once; nothing leaves the machine), the verify pod's pull policy IfNotPresent
UNPULLABLE = "localhost:1/gpushare-e2e/absent:0"
VERIFY_LABEL = "app.kubernetes.io/name=gpushare-verify"


def host_interfaces() -> set[str]:
    """The network interfaces of this machine's own (root) network namespace."""
    return {p.name for p in Path("/sys/class/net").iterdir()}


@pytest.fixture(scope="module")
def node(gpushare_image: Path) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("the e2e cluster needs root (mount namespaces for its kubelets)")
    spec = NodeSpec(NODE, cards(1, CARD_4GIB, 2), runtime="containerd", pod_network=True)
    with running_cluster([spec], logs=REPO / "e2e" / "logs" / "verify-cluster") as c:
        agent = c.nodes[NODE]
        assert agent.containerd is not None
        started = time.monotonic()
        agent.containerd.import_image(gpushare_image, timeout=1200)
        print(f"image imported in {time.monotonic() - started:.0f} s")
        yield c


def verify_pods(cluster: Cluster) -> list[str]:
    pods = cluster.api.get("/api/v1/namespaces/default/pods", labelSelector=VERIFY_LABEL)
    return [p["metadata"]["name"] for p in pods["items"]]


def test_a_pod_off_the_host_network_runs_in_its_own_namespace_and_logs_through_the_api(
    node: Cluster,
) -> None:
    """The pod network itself: a pod that is not on the host network gets a sandbox, an
    address of the node's range and a network namespace of its own (``lo`` and ``eth0``
    only); nothing is added to the machine's namespace; its log is read through the API
    server (pods/log: the API server reaches the kubelet at the Node's address); once the
    pod is deleted its address is released."""
    before = host_interfaces()
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "networked", "namespace": "default"},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", "cat /proc/net/dev; echo done"],
                }
            ],
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "nodeName": NODE,
        },
    }
    node.create_pod(manifest)
    try:
        pod = node.wait_pod("default", "networked", "Succeeded")
        assert not pod["spec"].get("hostNetwork"), pod["spec"]
        subnet = ipaddress.ip_network(pod_subnet(node.nodes[NODE].kubelet_port))
        assert ipaddress.ip_address(pod["status"]["podIP"]) in subnet, (pod["status"], subnet)
        reply = node.api.request("GET", "/api/v1/namespaces/default/pods/networked/log")
        assert reply.status_code == 200, reply.text
        assert reply.text.rstrip().endswith("done"), reply.text
        # /proc/net/dev: two header lines, then one "name: counters" line per interface
        names = {line.split(":")[0].strip() for line in reply.text.splitlines()[2:-1]}
        assert names == {"lo", "eth0"}, reply.text
        assert host_interfaces() == before
    finally:
        node.delete_pod("default", "networked")
    # the sandbox's teardown ran the plugins' DEL: host-local released the address (its
    # state keeps one file per address in use, beside its lock and last-reserved marker)
    state = node.nodes[NODE].dir / "cni-ipam" / "gpushare-e2e-pods"

    def released() -> bool:
        return not [p for p in state.iterdir() if p.name[:1].isdigit()]

    wait_for("the pod's address released", released, 60)


def test_verify_on_a_node_without_a_gpu_ends_in_the_probes_verdict(node: Cluster) -> None:
    """docs/operations.md's verdict for a node without a GPU: the probe's pod ran (its
    sandbox on the pod network, its container given the daemon's share), the probe found no
    driver and said so, verify read that from the pod's log through the API server, printed
    it and exited 3, then deleted its pod; it did not wait for its timeout."""
    node.wait_allocatable(NODE, lambda a: int(a.get(MEMORY, 0)) == 32)
    started = time.monotonic()
    done = node.kubectl_gpushare("verify", "--node", NODE, "--image", GPUSHARE_IMAGE)
    print(f"verify took {time.monotonic() - started:.1f} s")
    out = done.stdout + done.stderr
    print(out)
    assert done.returncode == 3, out
    assert "the probe did not report (Failed; terminated: Error); log: " in out, out
    assert "probe: cannot run: libcuda.so.1" in out, out
    assert "the pod cannot run" not in out, out
    assert "did not finish within" not in out, out
    (created,) = [line for line in out.splitlines() if line.startswith("created pod ")]
    name = created.split()[2].split("/")[1]
    assert f"deleted pod default/{name}" in out, out
    wait_for(f"pod default/{name} to be gone", lambda: node.pod("default", name) is None, 60)
    assert verify_pods(node) == []


def test_verify_with_an_image_that_cannot_be_pulled_stops_on_the_kubelets_reason(
    node: Cluster,
) -> None:
    """Where no probe can run, with a pod network: the image cannot be pulled (the registry
    refuses the connection), the kubelet says ErrImagePull (then ImagePullBackOff), and
    verify stops at once on that reason (exit 3, the verdict of a node where no probe could
    run), deleting its pod, not after its 300 s wait."""
    started = time.monotonic()
    done = node.kubectl_gpushare("verify", "--node", NODE, "--image", UNPULLABLE)
    print(f"verify took {time.monotonic() - started:.1f} s")
    out = done.stdout + done.stderr
    print(out)
    assert done.returncode == 3, out
    assert any(
        f"the pod cannot run: {reason}: " in out for reason in ("ErrImagePull", "ImagePullBackOff")
    ), out
    assert "did not finish within" not in out, out
    assert "deleted pod default/gpushare-verify-" in out, out
    wait_for("the verify pod to be gone", lambda: not verify_pods(node) or None, 60)
