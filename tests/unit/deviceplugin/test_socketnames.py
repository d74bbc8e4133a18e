"""Which socket names are a daemon instance's own, and which are gpushare's at all
(issue 39 item 5: two daemons of one node never touch each other's sockets)."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.deviceplugin.socketnames import (
    draw_token,
    instance_name,
    leftover_candidates,
    ours,
    renewal_name,
)
from gpushare.share.devices import Resource

BASES = [r.socket_name for r in Resource] + [
    "gpushare-gpu.sock",
    "gpushare-gpu.shared.sock",
    "gpushare-mig-1g.5gb.sock",
]
tokens = st.text(alphabet="0123456789abcdef", min_size=6, max_size=6)
names = st.text(alphabet=string.ascii_letters + string.digits + ".-_/", max_size=40)


def test_an_instance_serves_on_names_of_its_own() -> None:
    assert instance_name("gpushare-vcuda-memory.sock", "1a2b3c") == (
        "gpushare-vcuda-memory.1a2b3c.sock"
    )
    assert renewal_name("gpushare-vcuda-memory.sock", "1a2b3c", 2) == (
        "gpushare-vcuda-memory.1a2b3c-2.sock"
    )
    assert instance_name("gpushare-mig-1g.5gb.sock", "00ff00") == "gpushare-mig-1g.5gb.00ff00.sock"
    with pytest.raises(ValueError):
        renewal_name("gpushare-gpu.sock", "1a2b3c", 0)
    with pytest.raises(ValueError):
        instance_name("kubelet.sock", "1a2b3c")


def test_tokens_are_six_hex_digits_and_differ() -> None:
    drawn = {draw_token() for _ in range(50)}
    assert len(drawn) == 50
    assert all(len(t) == 6 and set(t) <= set("0123456789abcdef") for t in drawn)


@pytest.mark.parametrize(
    ("name", "is_ours"),
    [
        ("gpushare-vcuda-memory.sock", True),  # a release before per-instance names
        ("gpushare-vcuda-core.1a2b3c.sock", True),
        ("gpushare-gpu.1a2b3c-4.sock", True),
        ("kubelet.sock", False),
        ("nvidia-gpu.sock", False),
        (".gpushare-vcuda-memory.1a2b3c.sock.12-7f", False),  # bound hidden: never ours
        (".gpushare-gpu.sock", False),
        ("gpushare-.sock", False),
        ("gpushare-x.socket", False),
        ("gpushare-x/y.sock", False),
    ],
)
def test_which_names_are_gpushares(name: str, is_ours: bool) -> None:
    assert ours(name) is is_ours


@given(
    own=tokens,
    other=tokens,
    base=st.sampled_from(BASES),
    n=st.integers(1, 1000),
)
def test_an_instance_never_probes_its_own_names_and_always_anothers(
    own: str, other: str, base: str, n: int
) -> None:
    mine = [instance_name(base, own), renewal_name(base, own, n)]
    theirs = [instance_name(base, other), renewal_name(base, other, n)]
    found = leftover_candidates([*mine, *theirs, "kubelet.sock", f".{theirs[0]}.1-2"], own)
    if own == other:
        assert found == []
    else:
        assert found == sorted(theirs)


@given(st.lists(names, max_size=20), tokens)
def test_every_candidate_is_gpushares_and_no_dot_file(listing: list[str], token: str) -> None:
    for name in leftover_candidates(listing, token):
        assert ours(name) and not name.startswith(".") and "/" not in name
        assert name in listing
