"""A state object (ConfigMap ``gpushare-node-<node>``) reads back as what the daemon
wrote, and is not believed once its name, the node it names or its owner disagree."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpushare.kube import stateobject

LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
NODE = st.lists(LABEL, min_size=1, max_size=3).map(".".join)


@given(node=NODE, uid=st.uuids().map(str), text=st.text(max_size=50))
def test_what_the_daemon_writes_reads_back(node: str, uid: str, text: str) -> None:
    obj = stateobject.state_object("gpushare.io", "ns", node, uid, text)
    read = stateobject.read_state_object(obj, "gpushare.io")
    assert (read.node, read.text, read.problem, read.owner_uid) == (node, text, "", uid)
    assert obj["metadata"]["labels"][stateobject.selector_label("gpushare.io")] == "true"


@given(
    node=NODE,
    other=NODE,
    change=st.sampled_from(["name", "annotation", "owner name", "owner kind", "no owner"]),
)
def test_any_disagreement_is_a_problem(node: str, other: str, change: str) -> None:
    obj = stateobject.state_object("gpushare.io", "ns", node, "uid", "{}")
    meta = obj["metadata"]
    if other == node:
        other = node + "x"
    if change == "name":
        meta["name"] = stateobject.object_name(other)
    elif change == "annotation":
        meta["annotations"]["gpushare.io/node"] = other
    elif change == "owner name":
        meta["ownerReferences"][0]["name"] = other
    elif change == "owner kind":
        meta["ownerReferences"][0]["kind"] = "Pod"
    else:
        del meta["ownerReferences"]
    read = stateobject.read_state_object(obj, "gpushare.io")
    assert read.text is None and read.problem


def test_a_node_name_too_long_for_an_object_has_none() -> None:
    assert stateobject.object_name("n" * 239) == "gpushare-node-" + "n" * 239
    assert stateobject.object_name("n" * 240) == ""
