"""The chart and `kubectl gpushare install` as a user deploys them (issue 39 item 3 and its
Proof), on a cluster of its own whose one node runs a real containerd and runc
(tests/e2e/real_runtime.py) under its real kubelet.

Every command is the README's own (README.md, "Deploy"), read from it through
``readme_commands.argv`` with its placeholders filled (``REF``, ``REGISTRY``, the node's
name): the `helm` built by e2e/build-helm.sh from Helm's Go module, the `kubectl` built
from the cluster's Kubernetes modules, the repository's `kubectl-gpushare`. The image is
`make image-archive STANDINS=all`'s tar (the session fixture ``gpushare_image``, shared
with test_image.py and test_daemonset_real.py), imported into the node's containerd.

What the e2e adds, each TEST ONLY and forced by this machine (no pod network, no
kube-proxy, nodes sharing one network; e2e/README.md, "The chart and kubectl gpushare
install as shipped"): to `helm install` a values file (:func:`values_file`) of documented
chart values only (``hostNetwork``, ``extraEnv`` with ``KUBERNETES_SERVICE_HOST/PORT``,
``config.simulate``, ``config.metricsPort``); after `kubectl gpushare install`, which has
no such settings, one `kubectl patch` of its DaemonSet (:func:`only_test_patch`: the same
as test_daemonset_real.py's overlay, and ``GPUSHARE_SIMULATE``).

In file order, on one node: the chart installed, its daemon registered and a GPU pod's
limits read from inside; the README's uninstall of it (``kubectl gpushare uninstall
--all``, then ``helm uninstall``) leaving nothing of gpushare in the cluster, on the
node's kubelet or in its host directory; then `kubectl gpushare install` on the same
node, the same checks, and its uninstall.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import readme_commands
import yaml
from kube_cluster import (
    CORE,
    HOST_LIB_DIR,
    MEMORY,
    PREFIX,
    REPO,
    Cluster,
    NodeSpec,
    free_port,
    load_manifests,
    pod_manifest,
    running_cluster,
    wait_for,
)
from local_image import environ
from test_daemonset_real import (
    GPUS,
    NODE,
    NS,
    OPT_IN,
    UNITS,
    daemon_pods,
    keep_daemon_logs,
)

#: e2e/build-helm.sh's Helm CLI; $GPUSHARE_E2E_HELM names another.
HELM = Path(os.environ.get("GPUSHARE_E2E_HELM") or REPO / "e2e" / "bin-helm" / "helm")
SIMULATE = f"{HOST_LIB_DIR}/test/node.yaml"  # docs/deploy.md, "On a node without a GPU"
_VERSION = re.search(
    r'^__version__ = "(.+)"$', (REPO / "src" / "gpushare" / "__init__.py").read_text(), re.M
)
assert _VERSION is not None
VERSION = _VERSION.group(1)
#: Where the image is, as the node's containerd names the tar's gpushare:<version>.
REGISTRY = "docker.io/library"
REF = f"{REGISTRY}/gpushare:{VERSION}"
PLACES = {"REF": REF, "REGISTRY": REGISTRY, "gpu-node-1": NODE}

HELM_INSTALL = (
    "helm install gpushare charts/gpushare -n kube-system --set image.repository=REGISTRY/gpushare"
)
LABEL = "kubectl label node gpu-node-1 gpushare.io/enabled=true"
INSTALL = "kubectl gpushare install --node gpu-node-1 --image REF"
UNINSTALL = "kubectl gpushare uninstall --all"
HELM_UNINSTALL = "helm uninstall gpushare -n kube-system"


def helm(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """The Helm CLI against the cluster (admin kubeconfig), from the repository's root (the
    README's ``charts/gpushare``), its own config, cache and data under the cluster's
    directory; never raises on its exit code."""
    if not HELM.exists():
        raise FileNotFoundError(f"missing {HELM}: run `make e2e-build` (e2e/build-helm.sh)")
    home = cluster.dir / "helm"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "HELM_"))}
    env |= {
        "KUBECONFIG": str(cluster.admin_kubeconfig),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    return subprocess.run(
        [str(HELM), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def run_readme(cluster: Cluster, command: str, *extra: str) -> str:
    """Run the README's ``command`` (readme_commands.argv: refused unless the README holds
    it) with the e2e's placeholders, ``extra`` appended (TEST ONLY, said in the table)."""
    argv = readme_commands.argv(command, PLACES) + list(extra)
    if argv[:2] == ["kubectl", "gpushare"]:
        done = cluster.kubectl_gpushare(*argv[2:])
    elif argv[0] == "kubectl":
        done = cluster.kubectl(*argv[1:])
    elif argv[0] == "helm":
        done = helm(cluster, *argv[1:])
    else:
        raise AssertionError(f"no runner for {argv[0]!r}")
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stdout}{done.stderr}"
    print(f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}")
    return done.stdout


def values_file(cluster: Cluster) -> Path:
    """The chart's TEST-ONLY values (module docstring), documented values only."""
    values = {
        "hostNetwork": True,
        "extraEnv": [
            {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(cluster.api_port)},
        ],
        "config": {"simulate": SIMULATE, "metricsPort": free_port()},
    }
    path = cluster.dir / "test-values.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def only_test_patch(cluster: Cluster) -> list[dict[str, Any]]:
    """The JSON patch given to `kubectl gpushare install`'s DaemonSet (TEST ONLY): what
    test_daemonset_real.py's overlay gives `kubectl apply -k`, and ``GPUSHARE_SIMULATE``."""
    port = free_port()
    container = "/spec/template/spec/containers/0"
    env = {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(cluster.api_port),
        "GPUSHARE_SIMULATE": SIMULATE,
    }
    return [
        {"op": "add", "path": "/spec/template/spec/hostNetwork", "value": True},
        {"op": "add", "path": f"{container}/args/-", "value": "--metrics-address=127.0.0.1"},
        {"op": "add", "path": f"{container}/args/-", "value": f"--metrics-port={port}"},
        {"op": "replace", "path": f"{container}/ports/0/containerPort", "value": port},
    ] + [
        {"op": "add", "path": f"{container}/env/-", "value": {"name": k, "value": v}}
        for k, v in env.items()
    ]


@pytest.fixture(scope="module")
def chart_cluster(gpushare_image: Path) -> Iterator[Cluster]:
    """One unlabelled containerd node with the image imported and the simulated node file
    in its host directory; nothing of gpushare installed."""
    spec = NodeSpec(NODE, GPUS, labels={}, runtime="containerd", host_lib_dir=True)
    with running_cluster([spec], logs=REPO / "e2e" / "logs" / "chart-cluster", install=False) as c:
        agent = c.nodes[NODE]
        assert agent.containerd is not None
        # on the node: ctr -n k8s.io images import dist/gpushare-<version>-<arch>.tar
        agent.containerd.import_image(gpushare_image, timeout=1200)
        (agent.vgpu / "test").mkdir(exist_ok=True)
        (agent.vgpu / "test" / "node.yaml").write_text(yaml.safe_dump({"gpus": GPUS}))
        try:
            yield c
        finally:
            keep_daemon_logs(c)


def ready_daemon_pod(cluster: Cluster, timeout: float = 180) -> dict[str, Any]:
    """The DaemonSet's pod on the node once Ready (/readyz: GPUs served, resources
    registered) and on the host network (the TEST-ONLY setting applied)."""

    def ready() -> dict[str, Any] | None:
        for pod in daemon_pods(cluster):
            statuses = pod.get("status", {}).get("containerStatuses") or []
            if pod["spec"].get("hostNetwork") and statuses and all(s["ready"] for s in statuses):
                return pod
        return None

    return wait_for("the DaemonSet's pod Ready on the node", ready, timeout, step=0.5)


def check_the_daemon_runs_and_serves(cluster: Cluster) -> None:
    """The daemon pod from the image at REF (init container done), registered with the
    kubelet (32 units), and a GPU pod's limits as its own process has them."""
    pod = ready_daemon_pod(cluster)
    assert pod["spec"]["nodeName"] == NODE
    assert pod["spec"]["serviceAccountName"] == "gpushare"
    assert [c["image"] for c in pod["spec"]["containers"]] == [REF]
    (init,) = pod["status"]["initContainerStatuses"]
    assert init["name"] == "cache-fs" and init["state"]["terminated"]["exitCode"] == 0, init
    allocatable = cluster.wait_allocatable(NODE, lambda a: int(a.get(MEMORY, 0)) == UNITS)
    assert int(allocatable[CORE]) == 200
    name = f"limits-{pod['metadata']['uid'][:8]}"
    cluster.create_pod(pod_manifest(name, {MEMORY: 4, CORE: 30}, node=NODE, report=True))
    try:
        cluster.wait_pod("default", name, "Running")
        env = environ(cluster.wait_report("default", name, "main"))
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m", env
        assert env["CUDA_DEVICE_SM_LIMIT"] == "30", env
        assert env["NVIDIA_VISIBLE_DEVICES"] in {g["uuid"] for g in GPUS}, env
        assert env["LD_PRELOAD"] == f"{HOST_LIB_DIR}/libvgpu.so", env
    finally:
        cluster.delete_pod("default", name)


def check_nothing_of_gpushare_is_left(cluster: Cluster, objects: list[dict[str, Any]]) -> None:
    """``objects`` (what the install created) gone; no daemon pod, no state object, no
    gpushare label or annotation on the Node, no allocatable gpushare resource; on the
    node no plugin socket, no CDI spec, and in its host directory nothing but the e2e's own
    test/ and no mount below it (no GPU container runs: uninstall's host cleanup pod
    unmounted the cache tmpfs and removed the rest)."""
    paths = [cluster.api.path(obj) for obj in objects]
    wait_for(
        "the install's objects deleted",
        lambda: not [p for p in paths if cluster.api.get_or_none(p) is not None] or None,
        60,
    )
    wait_for("the daemon's pods to go", lambda: not daemon_pods(cluster) or None, 120)
    state = f"/api/v1/namespaces/{NS}/configmaps/gpushare-node-{NODE}"
    assert cluster.api.get_or_none(state) is None, state
    node = cluster.node(NODE)
    meta = node["metadata"]
    assert not [k for k in meta.get("labels", {}) if k.startswith(PREFIX)], meta["labels"]
    assert not [k for k in meta.get("annotations", {}) if k.startswith(PREFIX)]
    # the kubelet marks a gone plugin's devices unhealthy; its next node status says so
    cluster.wait_allocatable(
        NODE, lambda a: all(int(v) == 0 for k, v in a.items() if k.startswith(PREFIX))
    )
    agent = cluster.nodes[NODE]
    sockets = sorted(p.name for p in (agent.root / "device-plugins").glob("*.sock"))
    assert sockets == ["kubelet.sock"], sockets
    assert not list(agent.cdi_dir.glob("*")), list(agent.cdi_dir.glob("*"))
    assert agent.holder is not None
    host_lib = Path(f"/proc/{agent.holder.pid}/root{HOST_LIB_DIR}")
    left = {str(p.relative_to(host_lib)) for p in host_lib.rglob("*")}
    assert {p for p in left if not p.startswith("test")} == set(), sorted(left)
    mountinfo = Path(f"/proc/{agent.holder.pid}/mountinfo").read_text().splitlines()
    points = [line.split()[4] for line in mountinfo]
    below = [point for point in points if point.startswith(f"{HOST_LIB_DIR}/")]
    assert below == [], below


# ---- the chart ------------------------------------------------------------------------


def test_helm_install_runs_the_daemon_on_the_real_runtime(chart_cluster: Cluster) -> None:
    """README: `helm install gpushare charts/gpushare -n kube-system --set
    image.repository=REGISTRY/gpushare && kubectl label node gpu-node-1
    gpushare.io/enabled=true`, with the TEST-ONLY values file."""
    run_readme(chart_cluster, HELM_INSTALL, "-f", str(values_file(chart_cluster)))
    assert not daemon_pods(chart_cluster)  # the opt-in label: none before it
    run_readme(chart_cluster, LABEL)
    check_the_daemon_runs_and_serves(chart_cluster)
    # the chart's config reached the daemon: its ConfigMap, the simulated cards
    config = chart_cluster.api.get(f"/api/v1/namespaces/{NS}/configmaps/gpushare")
    assert f"simulate: {SIMULATE}" in config["data"]["config.yaml"], config["data"]


def chart_objects(cluster: Cluster) -> list[dict[str, Any]]:
    """What the release created: `helm get manifest`, and Helm's own release record."""
    done = helm(cluster, "get", "manifest", "gpushare", "-n", NS)
    assert done.returncode == 0, done.stderr
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    secrets = cluster.api.get(
        f"/api/v1/namespaces/{NS}/secrets", labelSelector="owner=helm,name=gpushare"
    )["items"]
    assert secrets, "Helm's release record"
    return objects + [
        {"apiVersion": "v1", "kind": "Secret", "metadata": s["metadata"]} for s in secrets
    ]


def test_helm_uninstall_leaves_nothing_of_gpushare(chart_cluster: Cluster) -> None:
    """README: `kubectl gpushare uninstall --all`, then `helm uninstall gpushare -n
    kube-system`. uninstall unlabels the node (the daemon, stopped on a node opted out,
    clears the host directory), waits for the pod to leave, removes what the daemon
    published (its Node labels and annotation, its state object) and keeps the chart's
    objects (not its own); Helm deletes those and its release record."""
    ready_daemon_pod(chart_cluster)
    objects = chart_objects(chart_cluster)
    kinds = {o["kind"] for o in objects}
    assert {"DaemonSet", "ServiceAccount", "ClusterRole", "ConfigMap", "Secret"} <= kinds, kinds
    out = run_readme(chart_cluster, UNINSTALL)
    assert "kept daemonset" in out.lower() or "not created by kubectl-gpushare" in out, out
    assert chart_cluster.api.get_or_none(f"/apis/apps/v1/namespaces/{NS}/daemonsets/gpushare")
    run_readme(chart_cluster, HELM_UNINSTALL)
    check_nothing_of_gpushare_is_left(chart_cluster, objects)


# ---- kubectl gpushare install ---------------------------------------------------------


def shipped_objects() -> list[dict[str, Any]]:
    """The objects `kubectl gpushare install` applies: daemonset/'s kustomization (the
    package's copy is the same, tests/deploy/test_deploy_manifests.py)."""
    kustomization = yaml.safe_load((REPO / "daemonset" / "kustomization.yaml").read_text())
    return load_manifests(*(REPO / "daemonset" / r for r in kustomization["resources"]))


def test_kubectl_gpushare_install_runs_the_daemon_on_the_real_runtime(
    chart_cluster: Cluster,
) -> None:
    """README: `kubectl gpushare install --node gpu-node-1 --image REF`. It applies the
    manifests and labels the node at once; the TEST-ONLY patch follows (the first pod,
    not on the host network, cannot get a sandbox here; the patch rolls it)."""
    assert not daemon_pods(chart_cluster)
    run_readme(chart_cluster, INSTALL)
    labels = chart_cluster.node(NODE)["metadata"]["labels"]
    assert labels.get(OPT_IN) == "true", labels
    for obj in shipped_objects():
        stored = chart_cluster.api.get(chart_cluster.api.path(obj))
        assert stored["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kubectl-gpushare"
    done = chart_cluster.kubectl(
        "-n", NS, "patch", "daemonset/gpushare", "--type=json",
        "-p", json.dumps(only_test_patch(chart_cluster)),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    check_the_daemon_runs_and_serves(chart_cluster)


def test_kubectl_gpushare_uninstall_leaves_nothing_of_gpushare(chart_cluster: Cluster) -> None:
    """README: `kubectl gpushare uninstall --all`, which deletes what install created."""
    ready_daemon_pod(chart_cluster)
    run_readme(chart_cluster, UNINSTALL)
    check_nothing_of_gpushare_is_left(chart_cluster, shipped_objects())
