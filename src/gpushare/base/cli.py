"""What every gpushare command line has in common: one-line usage errors (exit 2) and
``--version``.

argparse prints its usage block before an error; an operator reading a crash-looping
pod's log, or a script reading stderr, wants the one line that says what is wrong.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from gpushare import __version__

#: Exit status of every refusal of a command line, a setting or a config file.
EXIT_USAGE = 2


def one_line(text: str, limit: int = 1000) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class ChoicesFormatter(argparse.HelpFormatter):
    """Help that lists the values of every option with choices (argparse hides them
    behind the metavar)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text and action.choices and "%(choices)" not in text and not isinstance(
            action, argparse._SubParsersAction
        ):
            text += " (one of: " + ", ".join(str(c) for c in action.choices) + ")"
        return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (``prog: message``), exit 2.

    A flag must be spelled out: ``--memory-unit 512`` is refused, not taken for
    ``--memory-unit-mib`` (``allow_abbrev`` off; so are ``-x`` prefixes of long flags).
    ``--help`` lists the values of every option with choices.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", ChoicesFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {one_line(message)} (see {self.prog} --help)\n")
        sys.exit(EXIT_USAGE)


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )


def bounded_float(low: float, high: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in [low, high] (NaN and infinity refused:
    a NaN interval makes a wait loop spin)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not between {low:g} and {high:g}")
        return value

    return parse
