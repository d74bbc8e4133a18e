"""The README's install and uninstall commands are the e2e's, command for command (issue 39's
Proof): tests/e2e/readme_commands.py's table holds every command of README.md's marked
Deploy blocks and names the e2e test that runs each; these tests fail when the README
gains, loses or changes a command the table does not hold."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
E2E = REPO / "tests" / "e2e"


def _table() -> ModuleType:
    """tests/e2e/readme_commands.py, loaded by its path (tests/e2e is not on this suite's
    path: its conftest starts clusters)."""
    spec = importlib.util.spec_from_file_location("readme_commands", E2E / "readme_commands.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("readme_commands", module)
    spec.loader.exec_module(module)
    return module


TABLE = _table()


def test_every_readme_install_and_uninstall_command_is_one_the_e2e_runs() -> None:
    commands = TABLE.readme_commands()
    gained = sorted(set(commands) - set(TABLE.COMMANDS))
    lost = sorted(set(TABLE.COMMANDS) - set(commands))
    assert not gained, (
        f"README.md's Deploy blocks gained (or changed to) {gained}: make an e2e scenario "
        "run it and add it to tests/e2e/readme_commands.py's COMMANDS"
    )
    assert not lost, f"README.md's Deploy blocks lost {lost}: drop them from COMMANDS"


def test_the_marked_blocks_are_the_install_and_the_uninstall_of_deploy() -> None:
    """Two marked blocks, both in the README's "Deploy": the three installs, then the
    uninstalls (a marker moved elsewhere, or dropped, would leave a block unchecked)."""
    text = (REPO / "README.md").read_text()
    deploy = text.split("\n## Deploy\n", 1)[1].split("\n## ", 1)[0]
    assert deploy.count(TABLE.MARKER) == text.count(TABLE.MARKER) == 2
    commands = TABLE.readme_commands()
    assert commands[0].startswith("kubectl gpushare install ")
    assert any(c.startswith("helm install ") for c in commands)
    assert any(c.startswith("helm uninstall ") for c in commands)


def test_each_command_names_tests_that_exist() -> None:
    for command, runs in TABLE.COMMANDS.items():
        assert runs.tests and runs.how, command
        for test in runs.tests:
            file, name = test.split("::")
            source = (E2E / file).read_text()
            assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{command}: {test}"


def test_every_placeholder_of_the_commands_is_said() -> None:
    words = {w for command in TABLE.COMMANDS for w in re.findall(r"[A-Z]{3,}", command)}
    assert words <= set(TABLE.PLACEHOLDERS), words - set(TABLE.PLACEHOLDERS)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("charts/gpushare -n kube-system", "charts/gpushare -n gpushare"),
        ("kubectl gpushare uninstall --all", "kubectl gpushare uninstall --node gpu-node-1"),
        ("--image REF", "--image REF --runtime-class nvidia"),
    ],
)
def test_a_changed_command_is_caught(old: str, new: str) -> None:
    """The comparison above sees a command changed in place (not only one added or
    removed): an edited README gives a command the table does not hold."""
    text = (REPO / "README.md").read_text()
    edited = text.replace(old, new, 1)
    assert edited != text
    assert set(TABLE.readme_commands(edited)) - set(TABLE.COMMANDS)


def test_commands_are_split_at_and_and_lose_their_comments() -> None:
    text = f"{TABLE.MARKER} -->\n```\na  b && c d   # say\n# only a comment\n```\n"
    assert TABLE.readme_commands(text) == ["a b", "c d"]
    with pytest.raises(TABLE.ReadmeFormatError):
        TABLE.readme_commands(f"{TABLE.MARKER} -->\ntext\n")
    with pytest.raises(TABLE.ReadmeFormatError):
        TABLE.readme_commands(f"{TABLE.MARKER} -->\n```\na\n")


def test_argv_fills_the_placeholders_and_refuses_what_the_readme_does_not_say() -> None:
    places = {"REF": "docker.io/library/gpushare:0.1.0", "gpu-node-1": "node-1"}
    command = "kubectl gpushare install --node gpu-node-1 --image REF"
    assert TABLE.argv(command, places) == [
        "kubectl", "gpushare", "install", "--node", "node-1",
        "--image", "docker.io/library/gpushare:0.1.0",
    ]  # fmt: skip
    with pytest.raises(LookupError):
        TABLE.argv("kubectl delete namespace kube-system", places)
