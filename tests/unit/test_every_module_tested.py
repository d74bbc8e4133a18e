"""Every module of the package is imported by name by at least one test (issue 40 item
5): a module reached only through another one is a module whose own contract nobody
states. The ``__main__`` shims (``python -m`` entry points, run as programs by the tests)
are the exception; so is the generated ``_proto``. Unit test files have unique names
(pytest imports them by their base name)."""

from __future__ import annotations

import ast
import functools
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "gpushare"
TESTS = ROOT / "tests"


def modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        if "_proto" in relative.parts or relative.name in ("__init__", "__main__"):
            continue
        found.add(".".join(relative.parts))
    return found


@functools.cache
def imported_by_tests() -> frozenset[str]:
    """Every ``import a.b`` and ``from a.b import c`` (as ``a.b`` and ``a.b.c``) of the
    tests outside e2e/."""
    names: set[str] = set()
    for path in TESTS.rglob("*.py"):
        if "e2e" in path.relative_to(TESTS).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(names)


def test_every_module_is_imported_by_name_by_a_test() -> None:
    assert sorted(modules() - imported_by_tests()) == []


def test_the_check_finds_a_module_no_test_names() -> None:
    as_if_untested = imported_by_tests() - {"gpushare.share.placement"}
    assert sorted(modules() - as_if_untested) == ["gpushare.share.placement"]


def test_no_two_test_files_share_a_name() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py") if "e2e" not in p.parts)
    assert [name for name, count in names.items() if count > 1] == []
