"""docs/architecture.md's table of the programs says which folders of the package each
program loads; every console script is in it, and each row's "loads" column is what
importing the module that holds its ``main`` really puts into ``sys.modules`` (measured
in a fresh interpreter). So the daemon is seen never to load the extender, the probe or
the tools, and the probe to load nothing of the daemon."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"

MEASURE = """
import importlib, sys
importlib.import_module(sys.argv[1])
print(" ".join(sorted({m.split(".")[1] for m in sys.modules
    if m.startswith("gpushare.") and not m.startswith("gpushare._")})))
"""


def programs() -> dict[str, set[str]]:
    """Module holding ``main`` -> the folders the table says it loads."""
    text = DOC.read_text()
    table = text[text.index("## The programs") :]
    table = table[: table.index("\n## ")]
    rows: dict[str, set[str]] = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("`gpushare"):
            rows[cells[1].strip("`")] = set(cells[3].split())
    return rows


def test_every_console_script_is_a_program_in_the_table() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    modules = {target.partition(":")[0] for target in scripts.values()}
    assert modules <= programs().keys()
    assert {"gpushare.probe.checks", "gpushare.bench.run"} <= programs().keys()


@pytest.mark.parametrize("module", sorted(programs()))
def test_a_program_loads_the_folders_the_table_says(module: str) -> None:
    assert callable(importlib.import_module(module).main)
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, module], capture_output=True, text=True, check=True
    )
    assert set(done.stdout.split()) == programs()[module]


def test_the_daemon_and_the_probe_stay_apart() -> None:
    rows = programs()
    assert not rows["gpushare.daemon"] & {"extender", "probe", "ops", "sim", "bench", "dra"}
    assert rows["gpushare.probe.checks"] == {"probe"}
    assert "daemon" not in rows["gpushare.extender.httpserver"]
