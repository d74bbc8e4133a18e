"""Each card's enforcement backends, shown where an operator looks: the node labels, the
Node annotation (which readers of the version before it still decode), the metrics and
``kubectl gpushare inspect``; and published on the DRA devices, where a claim's CEL
selector can require ``driver``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.kube import nodestate
from gpushare.kube.labels import enforcement_labels
from gpushare.kube.nodestate import CardEnforcement, NodeGpuState

ROOT = Path(__file__).resolve().parents[3]
A = CardEnforcement("GPU-a", 0, "driver", "interposer", "auto: driver r615+")
B = CardEnforcement("GPU-b", 1, "interposer", "interposer", "auto: not driver: no CDI")
C = CardEnforcement("GPU-c", 2, "hardware", "hardware", "MIG device")


def test_labels_say_the_nodes_backend_or_mixed_and_count_each() -> None:
    assert enforcement_labels("gpushare.io", [A, B, C]) == {
        "gpushare.io/memory-enforcement": "mixed",
        "gpushare.io/memory-enforcement.driver": "1",
        "gpushare.io/memory-enforcement.interposer": "1",
        "gpushare.io/memory-enforcement.hardware": "1",
        "gpushare.io/compute-enforcement": "mixed",
        "gpushare.io/compute-enforcement.interposer": "2",
        "gpushare.io/compute-enforcement.hardware": "1",
    }
    same = enforcement_labels("x.io", [A, CardEnforcement("GPU-d", 1, "driver", "interposer")])
    assert same["x.io/memory-enforcement"] == "driver"
    assert same["x.io/memory-enforcement.driver"] == "2"
    assert set(same) <= set(nodestate.label_keys("x.io"))
    assert enforcement_labels("x.io", []) == {}


ENTRIES = st.builds(
    CardEnforcement,
    uuid=st.from_regex(r"GPU-[0-9a-f]{1,40}", fullmatch=True),
    index=st.integers(0, 64),
    memory=st.sampled_from(nodestate.MEMORY_BACKENDS),
    compute=st.sampled_from(nodestate.COMPUTE_BACKENDS),
    why=st.text(max_size=nodestate.MAX_REASON),
)


@given(st.lists(ENTRIES, max_size=8))
def test_the_annotation_carries_it_both_ways(entries: list[CardEnforcement]) -> None:
    state = NodeGpuState(1, "now", 256, (), enforcement=tuple(entries))
    assert nodestate.decode(nodestate.encode(state)).enforcement == tuple(entries)


def test_an_older_daemons_annotation_has_none_and_bad_entries_are_refused() -> None:
    old = json.dumps({"version": 1, "generation": 1, "memoryUnitMiB": 256, "gpus": []})
    assert nodestate.decode(old).enforcement == ()
    bad_entries = (
        [{"uuid": "GPU-a"}],
        [{"uuid": "", "index": 0, "memory": "x", "compute": "y"}],
        ["x"],
        [{"uuid": "a", "index": 0, "memory": "m" * 17, "compute": "y"}],
    )
    for bad in bad_entries:
        text = json.dumps({**json.loads(old), "enforcement": bad})
        with pytest.raises(ValueError, match="enforcement"):
            nodestate.decode(text)
    many = [{"uuid": f"G{i}", "index": i, "memory": "driver", "compute": "x"} for i in range(300)]
    with pytest.raises(ValueError, match="more than 256"):
        nodestate.decode(json.dumps({**json.loads(old), "enforcement": many}))


def _previous_nodestate() -> object:
    """kube/nodestate.py as the version before this one had it (git), loaded alone."""
    try:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", "cd3bd2e^:src/gpushare/kube/nodestate.py"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout with the earlier version")
    spec = importlib.util.spec_from_loader("nodestate_before", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["nodestate_before"] = module
    exec(compile(text, "nodestate_before.py", "exec"), module.__dict__)
    return module


def test_the_reader_before_this_version_decodes_the_new_annotation() -> None:
    before = _previous_nodestate()
    card = nodestate.CardState("GPU-a", 0, "A100", 40960, 160, 4, 100, 30, True)
    state = NodeGpuState(3, "now", 256, (card,), enforcement=(A, B))
    decoded = before.decode(nodestate.encode(state))  # type: ignore[attr-defined]
    assert decoded.generation == 3 and decoded.cards[0].memory_units_used == 4


def test_inspect_shows_which_backend_holds_each_card() -> None:
    from gpushare.ops.inspect import build_view, render_table, view_data

    card = nodestate.CardState("GPU-a", 0, "A100", 40960, 160, 4, 100, 30, True)
    state = NodeGpuState(3, "now", 256, (card,), enforcement=(A, B))
    node = {"metadata": {"name": "n1", "annotations": {
        nodestate.annotation_key("gpushare.io"): nodestate.encode(state)}}}  # fmt: skip
    view = build_view([node], [], "gpushare.io")
    table = render_table(view)
    assert "ENFORCED BY  memory: driver 0  interposer 1   compute: interposer 0,1" in table
    assert "no CDI" not in table
    assert "GPU 1: memory interposer (auto: not driver: no CDI)" in render_table(view, details=True)
    (shown,) = view_data(view)["nodes"]
    assert shown["enforcement"][0] == {
        "uuid": "GPU-a",
        "index": 0,
        "memory": "driver",
        "compute": "interposer",
        "why": "auto: driver r615+",
    }


def test_the_driver_claim_example_selects_what_the_slices_publish() -> None:
    import yaml

    from gpushare.config import Settings
    from gpushare.dra.model import MEMORY_ENFORCEMENT

    path = ROOT / "daemonset" / "examples" / "dra-driver-claim.yaml"
    template, pod = yaml.safe_load_all(path.read_text())
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    (selector,) = request["exactly"]["selectors"]
    driver = Settings().dra_driver
    assert selector["cel"]["expression"] == (
        f'device.attributes["{driver}"].{MEMORY_ENFORCEMENT} == "driver"'
    )
    assert request["exactly"]["deviceClassName"] == "gpushare.io"
    assert pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "gpu-4gi-driver"
    assert "```yaml\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate" in (
        ROOT / "docs" / "dra.md"
    ).read_text()
