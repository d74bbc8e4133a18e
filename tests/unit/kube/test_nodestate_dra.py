"""The DRA claims a node's published state lists per card, as hostile input: bounded,
validated, one clear error; older states (no ``mode``) and non-DRA cards read as before."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.kube import nodestate

CLAIM = {
    "namespace": "ml",
    "claim": "train-0-gpu",
    "request": "gpu",
    "device": "gpu-1",
    "memory_mib": 1024,
    "cores": 30,
}


def _state(**card: Any) -> str:
    whole = {
        "uuid": "GPU-b",
        "index": 1,
        "name": "T",
        "memory_mib": 7611,
        "healthy": True,
        "mode": "dra",
        **card,
    }
    return json.dumps(
        {
            "version": 1,
            "generation": 1,
            "updated": "",
            "memoryUnitMiB": 256,
            "gpus": [],
            "wholeGpus": [whole],
        }
    )


def _claim(**change: Any) -> dict[str, Any]:
    return {**CLAIM, **change}


def test_dra_claims_round_trip_and_other_cards_are_written_as_before() -> None:
    claims = (
        nodestate.DraClaimState("ml", "a", "gpu", "gpu-1", 1024, 30),
        nodestate.DraClaimState("ml", "old", "", "gpu-1", None, None),  # sizes not recorded
    )
    dra = nodestate.with_dra_claims(nodestate.WholeCardState("GPU-b", 1, "T", 7611, True), claims)
    assert (dra.claim_count, dra.memory_used_mib, dra.cores_used) == (2, 1024, 30)
    plain = nodestate.WholeCardState("GPU-c", 2, "T", 7611, True, held_by="ml/p/main")
    state = nodestate.NodeGpuState(3, "", 256, (), (dra, plain))
    text = nodestate.encode(state)
    assert nodestate.decode(text) == state
    written = json.loads(text)["wholeGpus"]
    assert written[0]["mode"] == "dra" and written[0]["claims"][1]["memory_mib"] is None
    assert set(written[1]) == {"uuid", "index", "name", "memory_mib", "healthy", "held_by", "mig"}
    older = json.loads(_state())
    del older["wholeGpus"][0]["mode"]
    card = nodestate.decode(json.dumps(older)).whole[0]
    assert (card.mode, card.claims, card.claim_count) == ("", (), 0)


def test_more_claims_than_listed_are_counted_and_flagged() -> None:
    claims = tuple(
        nodestate.DraClaimState("ml", f"c{i}", "gpu", "gpu-1", 256, 1) for i in range(70)
    )
    card = nodestate.with_dra_claims(nodestate.WholeCardState("GPU-b", 1, "T", 80000, True), claims)
    shown = nodestate.listed_claims(card)
    assert len(shown.claims) == nodestate.MAX_CLAIMS_PER_CARD and shown.claims_truncated
    assert (shown.claim_count, shown.memory_used_mib, shown.cores_used) == (70, 70 * 256, 70)
    state = nodestate.NodeGpuState(1, "", 256, (), (shown,))
    assert nodestate.decode(nodestate.encode(state)).whole == (shown,)
    assert nodestate.listed_claims(shown) == shown


@pytest.mark.parametrize(
    ("card", "error"),
    [
        ({"claims": {"a": CLAIM}}, "'claims' must be a list"),
        ({"claims": [CLAIM] * 65}, "more than 64 claims listed"),
        ({"claims": ["ml/a"]}, r"claims\[0\] must be an object"),
        ({"claims": [_claim(namespace="n" * 64)]}, "'namespace' must have 1 to 63"),
        ({"claims": [_claim(claim="")]}, "'claim' must have 1 to 253"),
        ({"claims": [_claim(claim=7)]}, "'claim' must be a str"),
        ({"claims": [_claim(request="r" * 128)]}, "'request' must have at most 127"),
        ({"claims": [_claim(device="d" * 64)]}, "'device' must have 1 to 63"),
        ({"claims": [_claim(memory_mib=-1)]}, "'memory_mib' must be between 0 and"),
        ({"claims": [_claim(memory_mib=2**40)]}, "'memory_mib' must be between 0 and"),
        ({"claims": [_claim(cores=True)]}, "'cores' must be an integer"),
        ({"claims": [_claim(cores="30")]}, "'cores' must be an integer"),
        ({"memory_used_mib": -5}, "'memory_used_mib' must be between 0 and"),
        ({"claim_count": 1.5}, "'claim_count' must be an integer"),
        ({"memory_total_mib": -1}, "'memory_total_mib' must be between 0 and"),
        ({"cores_total": "100"}, "'cores_total' must be an integer"),
        ({"mode": "d" * 17}, "'mode' must have at most 16"),
        ({"mode": ["dra"]}, "'mode' must be a str"),
    ],
)
def test_a_malformed_dra_card_makes_the_annotation_unreadable(card: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        nodestate.decode(_state(**card))


_names = st.text(max_size=300)


@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "namespace": _names,
                "claim": _names,
                "request": _names,
                "device": _names,
                "memory_mib": st.one_of(st.none(), st.integers(-5, 2**31)),
                "cores": st.one_of(st.none(), st.integers(-5, 200), st.booleans()),
            }
        ),
        max_size=70,
    )
)
def test_any_claim_list_reads_bounded_or_is_refused(claims: list[dict[str, Any]]) -> None:
    try:
        state = nodestate.decode(_state(claims=claims))
    except ValueError:
        return
    (card,) = state.whole
    assert len(card.claims) <= nodestate.MAX_CLAIMS_PER_CARD
    for claim in card.claims:
        assert 0 < len(claim.namespace) <= 63 and 0 < len(claim.claim) <= 253
        assert len(claim.request) <= 127 and 0 < len(claim.device) <= 63
        for figure in (claim.memory_mib, claim.cores):
            assert figure is None or (type(figure) is int and 0 <= figure <= 2**30)


def test_long_claim_names_are_listed_within_a_byte_budget() -> None:
    """Tenants choose claim and request names: 64 claims of the longest names on each of
    8 cards would pass the API server's 256 KiB for all of a Node's annotations."""
    longest = tuple(
        nodestate.DraClaimState("n" * 63, f"{i:03d}" + "c" * 250, "r" * 127, "gpu-1", 256, 1)
        for i in range(64)
    )
    cards = tuple(
        nodestate.listed_claims(
            nodestate.with_dra_claims(
                nodestate.WholeCardState(f"GPU-{n}", n, "T", 80000, True), longest
            )
        )
        for n in range(8)
    )
    assert all(c.claims_truncated and c.claim_count == 64 for c in cards)
    assert all(0 < len(c.claims) < 64 for c in cards)
    text = nodestate.encode(nodestate.NodeGpuState(1, "", 256, (), cards))
    assert len(text.encode()) < 128 * 1024
    assert nodestate.decode(text).whole == cards
    ordinary = tuple(
        nodestate.DraClaimState("team-a", f"train-{i}-gpu-xyz12", "gpu", "gpu-1", 256, 1)
        for i in range(64)
    )
    card = nodestate.with_dra_claims(
        nodestate.WholeCardState("GPU-b", 1, "T", 80000, True), ordinary
    )
    assert nodestate.listed_claims(card) == card  # ordinary names: all 64 listed
