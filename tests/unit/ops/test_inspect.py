"""``kubectl gpushare inspect``: the full output for a three-node fixture, table and JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kit.kube_double import KubeApiDouble

from gpushare.kube import nodestate
from gpushare.ops.inspect import build_view, main, render_json, render_table, render_yaml

PREFIX = "gpushare.io"
P4 = ("Tesla P4", 7611)
RTX_3090 = ("NVIDIA GeForce RTX 3090", 24259)


def _card(index: int, model: tuple[str, int], used: int, cores: int, healthy: bool = True) -> Any:
    name, mib = model
    return nodestate.CardState(
        uuid=f"GPU-{name.split()[-1]}-{index}",
        index=index,
        name=name,
        memory_mib=mib,
        memory_units=mib // 256,
        memory_units_used=used,
        core_units=100,
        core_units_used=cores,
        healthy=healthy,
    )


def _node(name: str, cards: list[nodestate.CardState] | None, generation: int) -> dict[str, Any]:
    annotations = {}
    if cards is not None:
        state = nodestate.NodeGpuState(generation, "2026-11-22T13:00:00Z", 256, tuple(cards))
        annotations[nodestate.annotation_key(PREFIX)] = nodestate.encode(state)
    allocatable = {"cpu": "16"}
    if name.startswith("gpu"):
        allocatable[f"{PREFIX}/vcuda-memory"] = "58"
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": name, "annotations": annotations},
        "status": {"allocatable": allocatable, "capacity": allocatable},
    }


def _pod(
    name: str, node: str, containers: dict[str, tuple[int, int, str]], phase: str = "Running"
) -> dict[str, Any]:
    """containers: name -> (memory units, core units, card UUID)."""
    specs, annotations = [], {}
    for container, (memory, core, uuid) in containers.items():
        limits = {}
        if memory:
            limits[f"{PREFIX}/vcuda-memory"] = str(memory)
        if core:
            limits[f"{PREFIX}/vcuda-core"] = str(core)
        specs.append({"name": container, "image": "cuda", "resources": {"limits": limits}})
        annotations[nodestate.pod_annotation_key(PREFIX, container)] = uuid
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations},
        "spec": {"nodeName": node, "containers": specs},
        "status": {"phase": phase},
    }


def fixture() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    p4 = [_card(0, P4, 20, 30), _card(1, P4, 24, 0)]
    rtx = [_card(0, RTX_3090, 91, 0), _card(1, RTX_3090, 0, 0, healthy=False)]
    nodes = [
        _node("gpu-b", rtx, 12),
        _node("gpu-a", p4, 7),
        _node("gpu-c", None, 0),
        _node("cpu-1", None, 0),
    ]
    p4_0, p4_1 = p4[0].uuid, p4[1].uuid
    nodes[1]["metadata"]["annotations"]["unrelated"] = "x"
    pods = [
        _pod("big-1", "gpu-a", {"main": (20, 30, p4_0)}),
        _pod("big-2", "gpu-a", {"main": (20, 0, p4_1)}),
        _pod("small", "gpu-a", {"main": (4, 0, p4_1)}),
        _pod("done", "gpu-a", {"main": (8, 0, p4_0)}, phase="Succeeded"),
        _pod("a", "gpu-b", {"main": (50, 0, rtx[0].uuid)}),
        _pod("b", "gpu-b", {"main": (40, 0, rtx[0].uuid), "sidecar": (1, 0, rtx[0].uuid)}),
    ]
    return nodes, pods


TABLE = """\
NODE gpu-a  (2 cards, 256 MiB units, generation 7, updated 2026-11-22T13:00:00Z)
  GPU  NAME      MEMORY MiB            UNITS  CORES   HEALTH
  0    Tesla P4  5120/7424   (69.0 %)  20/29  30/100  healthy
  1    Tesla P4  6144/7424   (82.8 %)  24/29  0/100   healthy

NODE gpu-b  (2 cards, 256 MiB units, generation 12, updated 2026-11-22T13:00:00Z)
  GPU  NAME                     MEMORY MiB             UNITS  CORES  HEALTH
  0    NVIDIA GeForce RTX 3090  23296/24064  (96.8 %)  91/94  0/100  healthy
  1    NVIDIA GeForce RTX 3090  0/24064      (0.0 %)   0/94   0/100  UNHEALTHY

NODE gpu-c: no daemon report: no state object, no gpushare.io/gpus annotation (daemon down?)

CLUSTER  3 nodes (2 reporting, 1 no daemon report), 4 cards (3 healthy)
  memory  34560/62976 MiB (54.9 %)
  cores   30/400 (7.5 %)
"""

GPU_A_DETAILS = """\
NODE gpu-a  (2 cards, 256 MiB units, generation 7, updated 2026-11-22T13:00:00Z)
  GPU  NAME             MEMORY MiB            UNITS  CORES   HEALTH
  0    Tesla P4         5120/7424   (69.0 %)  20/29  30/100  healthy
         ml/big-1/main  5120                  20     30
  1    Tesla P4         6144/7424   (82.8 %)  24/29  0/100   healthy
         ml/big-2/main  5120                  20     0
         ml/small/main  1024                  4      0
"""

GPU_B_DETAILS = """\
NODE gpu-b  (2 cards, 256 MiB units, generation 12, updated 2026-11-22T13:00:00Z)
  GPU  NAME                     MEMORY MiB             UNITS  CORES  HEALTH
  0    NVIDIA GeForce RTX 3090  23296/24064  (96.8 %)  91/94  0/100  healthy
         ml/a/main              12800                  50     0
         ml/b/main              10240                  40     0
         ml/b/sidecar           256                    1      0
  1    NVIDIA GeForce RTX 3090  0/24064      (0.0 %)   0/94   0/100  UNHEALTHY
"""

TABLE_DETAILS = f"""\
{GPU_A_DETAILS}
{GPU_B_DETAILS}
NODE gpu-c: no daemon report: no state object, no gpushare.io/gpus annotation (daemon down?)

CLUSTER  3 nodes (2 reporting, 1 no daemon report), 4 cards (3 healthy)
  memory  34560/62976 MiB (54.9 %)
  cores   30/400 (7.5 %)
"""


def _gpu(
    index: int, model: tuple[str, int], used: int, cores: int, healthy: bool, *containers: Any
) -> dict[str, Any]:
    name, mib = model
    return {
        "index": index,
        "uuid": f"GPU-{name.split()[-1]}-{index}",
        "name": name,
        "healthy": healthy,
        "offered": healthy,
        "heldBy": None,
        "memoryMib": mib,
        "memoryUnits": mib // 256,
        "memoryUnitsUsed": used,
        "memoryTotalMib": mib // 256 * 256,
        "memoryUsedMib": used * 256,
        "coreUnits": 100,
        "coreUnitsUsed": cores,
        "containers": [
            {
                "namespace": "ml",
                "pod": pod,
                "container": container,
                "memoryUnits": units,
                "memoryMib": units * 256,
                "coreUnits": core,
            }
            for pod, container, units, core in containers
        ],
    }


def _node_json(name: str, generation: int, *gpus: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "memoryUnitMib": 256,
        "generation": generation,
        "updated": "2026-11-22T13:00:00Z",
        "problem": None,
        "cardCount": len(gpus),
        "gpus": list(gpus),
        "wholeGpus": [],
    }


GPU_A_JSON = _node_json(
    "gpu-a",
    7,
    _gpu(0, P4, 20, 30, True, ("big-1", "main", 20, 30)),
    _gpu(1, P4, 24, 0, True, ("big-2", "main", 20, 0), ("small", "main", 4, 0)),
)
GPU_B_JSON = _node_json(
    "gpu-b",
    12,
    _gpu(
        0,
        RTX_3090,
        91,
        0,
        True,
        ("a", "main", 50, 0),
        ("b", "main", 40, 0),
        ("b", "sidecar", 1, 0),
    ),
    _gpu(1, RTX_3090, 0, 0, False),
)
GPU_C_JSON = {
    "name": "gpu-c",
    "memoryUnitMib": None,
    "generation": None,
    "updated": None,
    "problem": "no daemon report: no state object, no gpushare.io/gpus annotation "
    "(daemon down?)",
    "cardCount": 0,
    "gpus": [],
    "wholeGpus": [],
}
JSON = {
    "nodes": [GPU_A_JSON, GPU_B_JSON, GPU_C_JSON],
    "totals": {
        "nodes": 3,
        "unreportedNodes": 1,
        "cards": 4,
        "healthyCards": 3,
        "heldWhole": 0,
        "memoryMib": 62976,
        "memoryUsedMib": 34560,
        "memoryPercent": 54.9,
        "coreUnits": 400,
        "coreUnitsUsed": 30,
        "corePercent": 7.5,
    },
}


# -- the pure renderers -----------------------------------------------------------------


def test_table_for_three_nodes() -> None:
    view = build_view(*fixture(), PREFIX)
    assert render_table(view) == TABLE
    assert render_table(view, details=True) == TABLE_DETAILS


def test_json_for_three_nodes() -> None:
    text = render_json(build_view(*fixture(), PREFIX))
    assert json.loads(text) == JSON
    assert text.endswith("}\n")


def test_an_unreadable_annotation_is_shown_not_fatal() -> None:
    nodes, _ = fixture()
    nodes[0]["metadata"]["annotations"][nodestate.annotation_key(PREFIX)] = "[1]"
    view = build_view(nodes[:1], [], PREFIX)
    assert render_table(view) == (
        "NODE gpu-b: unreadable gpushare.io/gpus annotation: "
        "the gpus annotation must be a JSON object\n"
        "\n"
        "CLUSTER  1 node, 0 cards (0 healthy)\n"
        "  memory  0/0 MiB (-)\n"
        "  cores   0/0 (-)\n"
    )


# -- the command against an API server double --------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeApiDouble]:
    double = KubeApiDouble()
    double.start()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(double.kubeconfig(tmp_path / "kubeconfig")))
    nodes, pods = fixture()
    for obj in [*nodes, *pods]:
        double.add(obj)
    try:
        yield double
    finally:
        double.stop()


def test_inspect_reads_the_cluster(cluster: KubeApiDouble, capsys: Any) -> None:
    assert main([]) == 0
    assert capsys.readouterr().out == TABLE
    assert main(["-d"]) == 0
    assert capsys.readouterr().out == TABLE_DETAILS
    assert main(["-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == JSON


def test_inspect_one_node(cluster: KubeApiDouble, capsys: Any) -> None:
    assert main(["gpu-b", "-d"]) == 0
    out = capsys.readouterr().out
    assert out == GPU_B_DETAILS + (
        "\nCLUSTER  1 node, 2 cards (1 healthy)\n"
        "  memory  23296/48128 MiB (48.4 %)\n"
        "  cores   0/200 (0.0 %)\n"
    )
    assert cluster.calls("GET", "/api/v1/nodes/gpu-b")
    assert main(["nowhere"]) == 1
    assert capsys.readouterr().err == "kubectl gpushare inspect: node 'nowhere' not found\n"
    assert main(["cpu-1"]) == 1
    assert (
        capsys.readouterr().err == "kubectl gpushare inspect: node 'cpu-1' has no gpushare GPUs\n"
    )


def test_no_cluster_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kubectl gpushare inspect: no usable kubeconfig:")
    assert captured.err.count("\n") == 1


def test_unreachable_api_server_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    double = KubeApiDouble()
    double.start()
    config = double.kubeconfig(tmp_path / "kubeconfig")
    double.stop()  # nothing listens there any more
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(config))
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kubectl gpushare inspect: cannot reach the API server at http://127")
    assert err.endswith(": [Errno 111] Connection refused\n")
    assert err.count("\n") == 1


def test_an_api_error_is_one_line_and_exit_1(cluster: KubeApiDouble, capsys: Any) -> None:
    cluster.fail_next(1, status=403)
    assert main(["gpu-a"]) == 1
    assert capsys.readouterr().err == (
        "kubectl gpushare inspect: the API server answered 403 Forbidden: injected failure\n"
    )


# -- kubectl-like flags and outputs -------------------------------------------------------


def _keys(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield key
            yield from _keys(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _keys(inner)


def test_json_and_yaml_use_one_key_style_and_say_the_same() -> None:
    import yaml

    view = build_view(*fixture(), PREFIX)
    data = json.loads(render_json(view))
    assert all(key.isidentifier() and "_" not in key and key[0].islower() for key in _keys(data))
    assert yaml.safe_load(render_yaml(view)) == data


def test_kubeconfig_and_context_flags_before_or_after_the_command(
    cluster: KubeApiDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from gpushare.ops.kubectl import main as kubectl

    config = os.environ["KUBECONFIG"]
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))  # the flag must win
    assert kubectl(["inspect", "--kubeconfig", config, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == JSON
    assert kubectl(["--kubeconfig", config, "--context", "double", "inspect", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == JSON
    assert kubectl([f"--kubeconfig={config}", "inspect", "--context=nowhere"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kubectl gpushare inspect: no usable kubeconfig:") and "nowhere" in err


def test_namespace_and_wide_and_yaml_outputs(cluster: KubeApiDouble, capsys: Any) -> None:
    import yaml

    assert main(["-n", "elsewhere", "-o", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    containers = [c for n in data["nodes"] for g in n["gpus"] for c in g["containers"]]
    assert containers == []  # cards and totals stay whole
    assert data["totals"] == JSON["totals"]
    assert main(["-n", "ml", "-o", "yaml"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == JSON
    assert main(["gpu-a", "-o", "wide"]) == 0
    wide = capsys.readouterr().out
    assert "UUID" in wide.splitlines()[1] and "GPU-P4-0" in wide
    assert "ml/big-1/main" in wide  # wide lists the containers too
    assert "CLUSTER  1 node, 2 cards (2 healthy)" in wide


def test_inspect_imports_none_of_the_clients_typed_apis_or_models(cluster: KubeApiDouble) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gpushare.ops.kubectl", "inspect", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == JSON
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "kubernetes.config.kube_config" in imported  # it did use the client
    heavy = [
        n for n in imported if n.startswith(("kubernetes.client.api.", "kubernetes.client.models."))
    ]
    assert heavy == []
