"""The MPS control daemon stand-in, put on a path the daemon is configured with."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

STANDIN = Path(__file__).parent / "standin" / "mps_control.py"


def install_standin(where: Path) -> Path:
    """An executable ``nvidia-cuda-mps-control`` in ``where`` that runs the stand-in."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / "nvidia-cuda-mps-control"
    path.write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN} "$@"\n')
    path.chmod(0o755)
    return path


def standin_state(pipe_dir: Path) -> dict[str, Any]:
    """What the running stand-in was told (its state file)."""
    return dict(json.loads((pipe_dir / "standin-state.json").read_text()))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"
