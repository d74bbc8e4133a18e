"""The package's shape: a composition root that is a list, classes and functions short
enough to hold one idea.

The layers themselves (imports only run downward) are checked by ``lint-imports`` in
``make test`` (the contract is in pyproject.toml)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "gpushare"
LONGEST_CLASS = 300
LONGEST_FUNCTION = 60
LONGEST_ROOT = 150

#: Functions that are long because they are a list, not because they hold two ideas: an
#: argument parser is one ``add_argument`` per flag (dividing it would scatter a
#: program's command line over functions that mean nothing alone). Only parsers and data
#: tables may stand here, each with its reason; an entry that is gone or short fails.
LONG_BY_NATURE = {
    "ops/kubectl.py:build_parser": "the kubectl plugin's argument parser: every "
    "subcommand and flag, one add_argument each",
    "extender/httpserver.py:build_parser": "the extender's argument parser: one "
    "add_argument per flag",
}

def _sizes(tree: ast.AST, where: str) -> dict[str, tuple[str, int]]:
    """Qualified name (``path:Class.method``, nested functions too) -> (``class`` or
    ``function``, its lines from ``def``/``class`` to its end, comments and docstrings
    included)."""
    found: dict[str, tuple[str, int]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                found[f"{where}:{prefix}{child.name}"] = (kind, lines)
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


@functools.cache
def sizes() -> dict[str, tuple[str, int]]:
    found: dict[str, tuple[str, int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        found |= _sizes(ast.parse(path.read_text()), path.relative_to(PACKAGE).as_posix())
    return found


def classes() -> dict[str, int]:
    return {name: lines for name, (kind, lines) in sizes().items() if kind == "class"}


def too_long(found: dict[str, tuple[str, int]]) -> dict[str, int]:
    """What breaks the size rules: a class over :data:`LONGEST_CLASS` lines, a function
    over :data:`LONGEST_FUNCTION` that is no parser or table of :data:`LONG_BY_NATURE`."""
    limit = {"class": LONGEST_CLASS, "function": LONGEST_FUNCTION}
    return {
        name: lines
        for name, (kind, lines) in found.items()
        if lines > limit[kind]
        and name not in LONG_BY_NATURE
    }


def test_no_class_over_300_lines_and_no_function_over_60() -> None:
    """A class or function pressed against the rule holds two ideas: divide it (never
    shorten comments or move a method out to meet the number)."""
    assert too_long(sizes()) == {}


def test_the_long_by_nature_are_still_long() -> None:
    """The allow-list stays short and true: each entry exists and still needs it."""
    found = sizes()
    assert {n: found.get(n, ("", 0))[1] > LONGEST_FUNCTION for n in LONG_BY_NATURE} == {
        n: True for n in LONG_BY_NATURE
    }


def test_the_size_rule_catches_a_long_function_and_a_long_class() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(LONGEST_FUNCTION))
    source = f"def short():\n    pass\n\nclass C:\n    def long(self):\n{body}\n"
    assert too_long(_sizes(ast.parse(source), "m.py")) == {"m.py:C.long": LONGEST_FUNCTION + 1}
    methods = "\n".join(f"    def m{i}(self):\n        pass\n" for i in range(LONGEST_CLASS // 2))
    found = _sizes(ast.parse(f"class Big:\n{methods}"), "m.py")
    assert too_long(found) == {"m.py:Big": found["m.py:Big"][1]}
    assert found["m.py:Big"][1] > LONGEST_CLASS


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


# --------------------------------------------------------------------------- the answer port

#: The one module that turns a grant into container edits (see share/answers.py).
ANSWER_PORT = "share/answers.py"
#: The daemon's packages: none of them but the port may build container edits. (The
#: stand-ins in sim/ and the in-container probe read what a container is told.)
DAEMON_PARTS = ("base", "share", "host", "kube", "node", "deviceplugin", "dra", "extender", "ops")
#: What only the port constructs: the edits and their parts, and the device naming.
EDIT_BUILDERS = {"ContainerEdits", "Mount", "DeviceSpec", "Hook", "with_device_list", "lock_mount"}
#: The environment a container is told (HAMi-core's limits, the interposer, the devices).
EDIT_ENV = ("NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_", "LD_PRELOAD")


def daemon_modules() -> list[Path]:
    found = [PACKAGE / "daemon.py", PACKAGE / "config.py"]
    for part in DAEMON_PARTS:
        found += sorted((PACKAGE / part).rglob("*.py"))
    return [p for p in found if p.relative_to(PACKAGE).as_posix() != ANSWER_PORT]


def edit_building(tree: ast.AST) -> list[str]:
    """Where a module builds container edits itself: a call of one of the port's
    builders (imported from it by name or reached as ``answers.<name>``), or a string
    (not a docstring; an f-string's parts too) that starts with a variable of the
    container environment the port sets."""
    names = set()  # local names bound to the port's builders
    modules = set()  # local names of the port module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "gpushare.share.answers":
            names |= {a.asname or a.name for a in node.names if a.name in EDIT_BUILDERS}
        if isinstance(node, ast.ImportFrom) and node.module == "gpushare.share":
            modules |= {a.asname or a.name for a in node.names if a.name == "answers"}
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in names:
                found.append(f"line {node.lineno}: {func.id}(...)")
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id in modules
                and func.attr in EDIT_BUILDERS
            ):
                found.append(f"line {node.lineno}: answers.{func.attr}(...)")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and node.value.startswith(EDIT_ENV)
        ):
            found.append(f"line {node.lineno}: {node.value[:40]!r}")
    return found


def test_only_the_answer_port_builds_container_edits() -> None:
    """Every front door (shared units, whole cards, MIG, DRA) calls
    ``answers.container_edits``; none builds env, mounts, device nodes or device names."""
    building = {}
    for path in daemon_modules():
        found = edit_building(ast.parse(path.read_text()))
        if found:
            building[path.relative_to(PACKAGE).as_posix()] = found
    assert building == {}


def test_the_answer_port_rule_catches_a_door_building_edits() -> None:
    door = (
        "from gpushare.share import answers\n"
        "from gpushare.share.answers import ContainerEdits as A, Mount\n"
        "def answer(uuid):\n"
        '    """Names NVIDIA_VISIBLE_DEVICES in a docstring only: fine."""\n'
        '    env = {"NVIDIA_VISIBLE_DEVICES": uuid, "CUDA_DEVICE_SM_LIMIT": "100"}\n'
        '    return A(env, [Mount("/a", "/b", True)]), answers.with_device_list\n'
        "def named(a, ids, listing):\n"
        "    return answers.with_device_list(a, ids, listing)\n"
    )
    found = sorted(f.split(":")[0] for f in edit_building(ast.parse(door)))
    assert found == ["line 5", "line 5", "line 6", "line 6", "line 8"]
    built = 'env = {f"CUDA_DEVICE_MEMORY_LIMIT_{i}": "1m" for i in range(2)}\n'
    assert len(edit_building(ast.parse(built))) == 1
    assert edit_building(ast.parse("from gpushare.share import answers\n")) == []
