"""``make scale`` against the REAL kube-apiserver and etcd (e2e/bin, v1.36.3), at toy
size: the loader's fake Nodes, state objects and bound Pods are what the extender reads
(every node kept by a filter by names, the GPU pods counted from one list).

Needs etcd and kube-apiserver from ``make e2e`` (``$GPUSHARE_E2E_BIN``, default
``e2e/bin``); skipped without them. No root, no kubelet: marked e2e by this folder's
conftest, so ``make e2e`` runs it and ``make test`` does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare.bench import scale
from gpushare.sim.controlplane import BIN, available

pytestmark = pytest.mark.skipif(
    not available(),
    reason=f"no Kubernetes binaries in {BIN} (make e2e builds them; GPUSHARE_E2E_BIN)",
)


def test_the_real_api_server_path_at_toy_size(tmp_path: Path) -> None:
    results = scale.run_real(
        tmp_path, counts=[6], full=[6], pods=[1200], requests=2, pod_status=True
    )
    assert "kube-apiserver" in results.api
    assert [(s["what"], s["total"]) for s in results.setup] == [("nodes", 6), ("pods", 1200)]
    assert {row["way"] for row in results.verbs} >= {"6 names", "6 full Nodes"}
    for row in results.verbs:
        assert row["filter"]["status"] == [200] and row["prioritize"]["status"] == [200]
        assert row["kept"] == [6]  # every node's cards read, each with room for the pod
    (start,) = results.starts
    assert start["pod_lists"] == 1
    # the daemons' state objects and the GPU pods (one in four) as the API server lists them
    assert start["state_objects"] == [6]
    assert start["gpu_pods"] == [300]
    assert start["encodings"] == ["protobuf"]  # kube-apiserver answered the list in protobuf
    text = "\n".join(scale.table(results))
    assert "| bound Pods | 1200 |" in text and "| 6 | 6 names |" in text
