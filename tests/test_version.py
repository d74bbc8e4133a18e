"""Issue 17.2: one version everywhere, and the start line that names every setting's origin."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import TESLA_P4, Node, cards
from procs import daemon_command

from gpushare import __version__
from gpushare.config import OPTIONS, yaml_key


def test_the_start_line_names_the_version_and_every_setting_with_its_origin(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    command = daemon_command(node)
    command[command.index("--library") + 1] = "/nonexistent/libvgpu.so"  # stops right after
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=30,
        env={"GPUSHARE_PLACEMENT": "spread", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 1
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    starting = [e for e in events if e["event"] == "starting"]
    assert len(starting) == 1
    line = starting[0]
    assert line["version"] == __version__
    assert line["python"] and line["grpc"]
    config = line["config"]
    assert set(config) == {yaml_key(o.name) for o in OPTIONS}
    assert config["placement"] == {"value": "spread", "from": "env GPUSHARE_PLACEMENT"}
    assert config["library"] == {"value": "/nonexistent/libvgpu.so", "from": "flag --library"}
    assert config["memoryUnitMib"] == {"value": 256, "from": "default"}


def test_version_flags_print_the_package_version() -> None:
    for module, prog in (
        ("gpushare.daemon", "gpushare-device-plugin"),
        ("gpushare.sim.demo", "gpushare-demo"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 0
        assert result.stdout.strip() == f"{prog} {__version__}"
