"""The one per-card override syntax (share/cardoverrides.py): what its pattern accepts is
exactly what its parser reads, unless something is given twice; every mistake is one
line naming the entry."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.config import matcher
from gpushare.share.cardoverrides import Wording, any_case, overrides_pattern, parse_overrides

WORDING = Wording("size", "sizes", "a size", option="cardSize")
SIZE = "(" + "|".join(any_case(w) for w in ("small", "large")) + ")"


def size(part: str, value: str) -> str:
    word = value.lower()
    if word not in ("small", "large"):
        raise ValueError(f"cardSize: {part!r}: {value!r} is not small or large")
    return word


def test_node_wide_and_per_card_values_are_read() -> None:
    assert parse_overrides(" Large , 0=small,GPU-a = LARGE,", size, WORDING) == (
        "large",
        {"0": "small", "GPU-a": "large"},
    )
    assert parse_overrides("", size, WORDING) == (None, {})


@pytest.mark.parametrize(
    ("text", "node_wide", "error"),
    [
        ("small,large", True, "cardSize: two node-wide sizes, small and large"),
        ("0=small,0=large", True, "cardSize: card 0 is given a size twice"),
        ("a b=small", True, "cardSize: 'a b=small' is not <card index or UUID>=<size>"),
        ("0=huge", True, "cardSize: '0=huge': 'huge' is not small or large"),
        ("small", False, "cardSize: 'small' is not <card index or UUID>=<size>"),
        ("=small", False, "is not <card index or UUID>=<size>"),
    ],
)
def test_each_mistake_is_one_line_naming_the_entry(text: str, node_wide: bool, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        parse_overrides(text, size, WORDING, node_wide=node_wide)


KEYS = st.sampled_from(["", "0", "GPU-a", " 1", "2 ", "a b", "=", "GPU-a="])
WORDS = st.sampled_from(["small", "LARGE", "Small", "huge", "", "=small"])


@given(
    st.lists(st.tuples(KEYS, WORDS), max_size=4),
    st.sampled_from([",", " , ", ",,"]),
    st.booleans(),
)
def test_the_pattern_accepts_exactly_what_parses(
    entries: list[tuple[str, str]], comma: str, node_wide: bool
) -> None:
    text = comma.join(f"{k}={w}" if k else w for k, w in entries)
    matches = matcher(overrides_pattern(SIZE, node_wide=node_wide)).search(text) is not None
    try:
        parse_overrides(text, size, WORDING, node_wide=node_wide)
    except ValueError as exc:
        assert "\n" not in str(exc)
        assert not matches or re.search("twice|two node-wide", str(exc)), (text, exc)
    else:
        assert matches, text
