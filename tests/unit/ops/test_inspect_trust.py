"""``kubectl gpushare inspect`` with tenant-written data: nothing printed as it came,
pod annotations believed only as far as the daemon's Node annotation backs them."""

from __future__ import annotations

import json
import unicodedata

from hypothesis import given
from hypothesis import strategies as st
from test_inspect import P4, _card, _node, _pod

from gpushare.kube import nodestate
from gpushare.ops.inspect import build_view, render_json, render_table
from gpushare.ops.printable import printable

PREFIX = "gpushare.io"
UNSAFE = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


@given(st.text(max_size=300))
def test_printable_leaves_no_control_or_format_character(text: str) -> None:
    shown = printable(text)
    assert not any(unicodedata.category(c) in UNSAFE for c in shown)
    if all(unicodedata.category(c) not in UNSAFE for c in text) and len(text) <= 253:
        assert shown == text  # ordinary text is untouched


def test_printable_bounds_the_length() -> None:
    assert printable("x" * 10_000) == "x" * 253 + "..."
    assert printable("\x1b[2J\x1b]0;owned\x07\u202eevil\r") == (
        "\\x1b[2J\\x1b]0;owned\\x07\\u202eevil\\x0d"
    )


def _cluster() -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    cards = [_card(0, P4, 8, 0), _card(1, P4, 4, 0)]
    nodes = [_node("gpu-a", cards, 3)]
    return nodes, [_pod("real", "gpu-a", {"main": (8, 0, cards[0].uuid)})]


def test_escape_sequences_in_names_and_node_state_are_shown_escaped() -> None:
    nodes, pods = _cluster()
    evil = "\x1b[1A\x1b[2Kfake line\r"
    nodes[0]["metadata"]["name"] = "gpu-a"  # type: ignore[index]
    state = nodestate.decode(nodes[0]["metadata"]["annotations"]["gpushare.io/gpus"])  # type: ignore[index]
    renamed = nodestate.NodeGpuState(
        state.generation,
        evil,
        state.memory_unit_mib,
        tuple(nodestate.CardState(**{**c.__dict__, "name": f"Tesla {evil}"}) for c in state.cards),
    )
    nodes[0]["metadata"]["annotations"]["gpushare.io/gpus"] = nodestate.encode(renamed)  # type: ignore[index]
    pods[0]["metadata"]["namespace"] = evil  # type: ignore[index]
    for details in (False, True):
        text = render_table(build_view(nodes, pods, PREFIX), details=details)
        assert "\x1b" not in text and "\r" not in text
        assert "\\x1b[1A" in text
    assert "\x1b" not in render_json(build_view(nodes, pods, PREFIX))


def test_a_tenant_annotation_claiming_more_than_the_daemon_counts_is_not_listed() -> None:
    nodes, pods = _cluster()
    card0 = json.loads(nodes[0]["metadata"]["annotations"]["gpushare.io/gpus"])["gpus"][0]  # type: ignore[index]
    # A second pod claims card 0 as well: 8 + 8 units > the 8 the daemon counts.
    pods.append(_pod("claimer", "gpu-a", {"main": (8, 0, card0["uuid"])}))
    view = build_view(nodes, pods, PREFIX)
    first = view.nodes[0].cards[0]
    assert first.disputed and first.containers == ()
    assert "not listed: pod annotations claim more" in render_table(view, details=True)
    gpus = json.loads(render_json(view))["nodes"][0]["gpus"]
    assert gpus[0]["containersDisputed"] is True and gpus[0]["containers"] == []
    assert "containersDisputed" not in gpus[1]


def test_pods_not_on_a_gpu_are_not_listed() -> None:
    nodes, pods = _cluster()
    uuid = json.loads(nodes[0]["metadata"]["annotations"]["gpushare.io/gpus"])["gpus"][1]["uuid"]  # type: ignore[index]
    pending = _pod("pending", "", {"main": (2, 0, uuid)})
    elsewhere = _pod("elsewhere", "cpu-1", {"main": (2, 0, uuid)})
    no_gpu = _pod("no-gpu", "gpu-a", {"main": (0, 0, uuid)})
    wrong_key = _pod("wrong-key", "gpu-a", {"main": (2, 0, uuid)})
    wrong_key["metadata"]["annotations"] = {"gpushare.io/gpu.ghost": uuid}  # type: ignore[index]
    view = build_view(nodes, [*pods, pending, elsewhere, no_gpu, wrong_key], PREFIX)
    listed = {c.pod for card in view.nodes[0].cards for c in card.containers}
    assert listed == {"real"}
