"""gpushare.base.cli: every command's usage errors are one line on stderr with exit 2,
flags are never abbreviated, --help lists the choices, and a bounded number refuses
NaN, infinity and what lies outside its range."""

from __future__ import annotations

import argparse

import pytest

import gpushare
from gpushare.base.cli import EXIT_USAGE, Parser, add_version, bounded_float, one_line


def test_one_line_flattens_whitespace_and_cuts_long_text() -> None:
    assert one_line("a\n  b\tc\n") == "a b c"
    cut = one_line("x" * 50, limit=10)
    assert cut == "xxxxxxx..." and len(cut) == 10
    assert one_line("x" * 10, limit=10) == "x" * 10


def test_an_error_is_one_line_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    parser = Parser(prog="tool")
    parser.add_argument("--count", type=int, required=True)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args([])
    assert stop.value.code == EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # no usage block before it
    assert err.startswith("tool: ") and err.endswith("(see tool --help)\n")
    assert "--count" in err


def test_a_flag_must_be_spelled_out(capsys: pytest.CaptureFixture[str]) -> None:
    parser = Parser(prog="tool")
    parser.add_argument("--memory-unit-mib", type=int)
    assert parser.parse_args(["--memory-unit-mib", "512"]).memory_unit_mib == 512
    with pytest.raises(SystemExit):
        parser.parse_args(["--memory-unit", "512"])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_help_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    parser = Parser(prog="tool")
    parser.add_argument("--placement", choices=["binpack", "spread"], help="how to place")
    parser.print_help()
    assert "how to place (one of: binpack, spread)" in " ".join(capsys.readouterr().out.split())


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    parser = Parser(prog="tool")
    add_version(parser)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"tool {gpushare.__version__}"


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "0.5", "11", "ten", ""])
def test_bounded_float_refuses_what_is_not_a_finite_number_in_range(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bounded_float(1.0, 10.0)(text)


def test_bounded_float_takes_its_bounds_and_what_lies_between() -> None:
    parse = bounded_float(1.0, 10.0)
    assert [parse(t) for t in ("1", "2.5", "10")] == [1.0, 2.5, 10.0]
