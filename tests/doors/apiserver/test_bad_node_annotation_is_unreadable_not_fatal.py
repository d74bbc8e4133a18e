"""Issue 32.12: a Node annotation nested too deep (or too large) to be the daemon's is
one unreadable node for ``kubectl gpushare inspect`` and the extender, and the node's
daemon overwrites it, where ``json`` used to raise RecursionError through all three."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import NODE, TESLA_P4, Node, cards
from hypothesis import given
from hypothesis import strategies as st
from kit.kube_double import KubeApiDouble
from kit.procs import eventually
from test_inspect import cluster  # noqa: F401  (the fixture)

from gpushare.kube import nodestate
from gpushare.ops.inspect import main

KEY = "gpushare.io/gpus"
DEEP = "[" * 100_000 + "]" * 100_000


@given(st.sampled_from("[{"), st.integers(33, 100_000), st.text(max_size=20))
def test_any_deep_or_large_text_is_a_value_error(opener: str, depth: int, tail: str) -> None:
    text = ('{"a":' if opener == "{" else "[") * depth + tail
    with pytest.raises(ValueError):
        nodestate.decode(text)


def test_a_huge_annotation_is_refused_before_parsing() -> None:
    with pytest.raises(ValueError, match="larger than"):
        nodestate.decode('{"x": "' + "y" * nodestate.MAX_ANNOTATION_BYTES + '"}')


def test_inspect_shows_a_deeply_nested_node_as_one_unreadable_line(
    cluster: KubeApiDouble,  # noqa: F811
    capsys: Any,
) -> None:
    node = cluster.get("Node", "gpu-b")
    node["metadata"]["annotations"][KEY] = DEEP
    cluster.add(node)
    assert main([]) == 0
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if "gpu-b" in line]
    assert bad == [
        f"NODE gpu-b: unreadable {KEY} annotation: the gpus annotation nests deeper "
        f"than {nodestate.MAX_NESTING} levels"
    ]
    assert "NODE gpu-a" in out  # the other nodes are still shown


def test_the_daemon_overwrites_a_deeply_nested_annotation(node: Node, api: KubeApiDouble) -> None:
    node_obj = api.get("Node", NODE)
    node_obj["metadata"]["annotations"] = {KEY: DEEP}
    api.add(node_obj)
    node.start(cards(TESLA_P4, 1), node_name=NODE)

    def published() -> nodestate.NodeGpuState | None:
        text = ((api.get("Node", NODE) or {}).get("metadata", {}).get("annotations") or {})[KEY]
        try:
            return nodestate.decode(text)
        except ValueError:
            return None

    state = eventually(published, 30.0)
    assert len(state.cards) == 1
