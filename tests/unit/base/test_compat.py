"""gpushare.base.compat: what the kubectl plugin's shared modules need on Python 3.9:
a string enum that prints as its value, and zip that refuses unequal lengths."""

from __future__ import annotations

import pytest

from gpushare.base.compat import StrEnum, zip_strict


class Colour(StrEnum):
    RED = "red"


def test_a_str_enum_member_is_its_value() -> None:
    assert Colour.RED == "red"
    assert str(Colour.RED) == "red" and f"{Colour.RED:>5}" == "  red"
    assert Colour("red") is Colour.RED


def test_zip_strict_pairs_equal_lengths_and_refuses_unequal_ones() -> None:
    assert list(zip_strict([1, 2], "ab")) == [(1, "a"), (2, "b")]
    assert list(zip_strict(iter([1]), (x for x in [2]))) == [(1, 2)]  # iterators too
    with pytest.raises(ValueError, match="different lengths"):
        zip_strict([1, 2], [1])
