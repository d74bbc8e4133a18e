"""gpushare.base.kerneltables: the kernel's ``<name> <number>`` tables read back, every
other line skipped."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpushare.base.kerneltables import named_numbers

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/_:.-", min_size=1, max_size=30)


def test_the_mig_minors_and_dmem_capacity_tables_are_read() -> None:
    assert named_numbers("gpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\n") == {
        "gpu0/gi2/access": 21,
        "gpu0/gi2/ci0/access": 22,
    }
    assert named_numbers("nvidia/0000:19:00.0/vidmem 150323855360\n") == {
        "nvidia/0000:19:00.0/vidmem": 150323855360
    }


def test_lines_that_are_no_name_and_whole_number_are_skipped() -> None:
    text = "\n".join(
        ["", "config 1 2", "alone", "negative -1", "fraction 1.5", "max max", "kept 7", "  "]
    )
    assert named_numbers(text) == {"kept": 7}


@given(st.dictionaries(NAMES, st.integers(min_value=0, max_value=1 << 62), max_size=20))
def test_any_table_written_as_the_kernel_writes_it_reads_back(table: dict[str, int]) -> None:
    text = "".join(f"{name} {number}\n" for name, number in table.items())
    assert named_numbers(text) == table
