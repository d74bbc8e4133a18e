"""The package's shape: a composition root that is a list, no class too large to read.

The layers themselves (imports only run downward) are checked by ``lint-imports`` in
``make test`` (the contract is in pyproject.toml)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gpushare"
LONGEST_CLASS = 300
LONGEST_ROOT = 150


def classes() -> dict[str, int]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                name = f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"
                found[name] = (node.end_lineno or node.lineno) - node.lineno + 1
    return found


def test_no_class_is_over_300_lines() -> None:
    sizes = classes()
    too_long = {n: s for n, s in sizes.items() if s > LONGEST_CLASS}
    assert too_long == {}


def test_the_composition_root_is_short() -> None:
    assert classes()["daemon.py:Daemon"] < LONGEST_ROOT


def test_the_folders_are_the_architecture() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {
        "base",
        "gpu",
        "share",
        "host",
        "kube",
        "node",
        "deviceplugin",
        "extender",
        "ops",
        "probe",
        "bench",
    } <= folders
    assert not [
        p.name
        for p in PACKAGE.glob("*.py")
        if p.stem not in {"__init__", "config", "daemon"}
    ]
