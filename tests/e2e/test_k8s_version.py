"""The suite runs on the Kubernetes minor it was asked for (``K8S_VERSION``: 1.36 or 1.37,
e2e/build.sh builds each into its own folder): the API server, the kubelets and the
scheduler say so themselves."""

from __future__ import annotations

from kube_cluster import K8S_VERSION, Cluster


def test_the_cluster_runs_the_minor_asked_for(cluster: Cluster) -> None:
    version = cluster.api.get("/version")
    assert version["gitVersion"].startswith(f"v{K8S_VERSION}."), version
    assert version["minor"] == K8S_VERSION.split(".")[1]
    for node in cluster.api.get("/api/v1/nodes")["items"]:
        kubelet = node["status"]["nodeInfo"]["kubeletVersion"]
        assert kubelet == version["gitVersion"], (node["metadata"]["name"], kubelet)
