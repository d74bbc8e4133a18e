"""``nodestate._nesting`` (the depth check before an annotation is parsed) peels the
brackets level by level in C; it must say exactly what the token-by-token scan says, for
JSON and for any other text (escapes, lone quotes, brackets in strings, brackets that do
not pair up), at every limit."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from gpushare.kube import nodestate

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text('[]{}"\\ab', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text('[]{}"\\a', max_size=4), inner, max_size=4)
    ),
    max_leaves=40,
)


@given(JSON, st.integers(0, 40))
def test_json_is_measured_as_the_token_scan_measures_it(value: object, limit: int) -> None:
    text = json.dumps(value)
    assert nodestate._nesting(text, limit) == nodestate._nesting_by_token(text, limit)


@given(st.text('[]{}"\\ax:,', max_size=200), st.integers(0, 40))
def test_any_text_is_measured_as_the_token_scan_measures_it(text: str, limit: int) -> None:
    assert nodestate._nesting(text, limit) == nodestate._nesting_by_token(text, limit)


@given(st.integers(0, 60), st.sampled_from(["[]", "{}"]), st.booleans())
def test_a_deep_value_stops_one_past_the_limit(depth: int, pair: str, in_string: bool) -> None:
    text = pair[0] * depth + pair[1] * depth
    if in_string:  # inside a string it is no nesting at all
        text = json.dumps(text)
    expected = 0 if in_string else min(depth, 33)
    assert nodestate._nesting(text, 32) == expected
