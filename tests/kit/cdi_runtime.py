"""What a CDI-aware runtime finally gives a container, for the tests.

The kubelet hands the runtime the container's env (the device plugin's answers first,
the pod spec's ``env`` after them) and mounts, and the CDI device names. The runtime
(containerd, CRI-O) keeps one value per name, the later one; then, for each CDI device
in turn, applies its ``containerEdits`` the way the CDI library does
(tags.cncf.io/container-device-interface ``pkg/cdi/container-edits.go`` with
``internal/ociedit/spec_editor.go``): an env entry replaces the variable of that name, a
mount first removes the mount at the same container path, and the mounts are then
sorted by depth (stable), so a shallower one is mounted first.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def read_devices(directories: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """Fully qualified CDI name -> its device entry, from the JSON specs there."""
    found: dict[str, dict[str, Any]] = {}
    for directory in directories:
        for path in sorted(Path(directory).glob("*.json")):
            spec = json.loads(path.read_text())
            for device in spec.get("devices", []):
                found[f"{spec['kind']}={device['name']}"] = device
    return found


def final(
    env: Sequence[tuple[str, str]],
    mounts: Sequence[tuple[str, str]],
    cdi_names: Sequence[str],
    directories: Iterable[Path],
) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(env, mounts as (container path, host path) in mount order) after the runtime's
    merge and the CDI devices; a name that resolves nowhere is an error, as in a runtime."""
    merged: dict[str, str] = {}
    for name, value in env:
        merged[name] = value  # the later duplicate wins
    result = list(mounts)
    devices = read_devices(directories)
    for cdi_name in cdi_names:
        edits: Mapping[str, Any] = devices[cdi_name].get("containerEdits", {})
        for entry in edits.get("env", []):
            name, value = entry.split("=", 1)
            merged[name] = value
        for mount in edits.get("mounts", []):
            same = [i for i, m in enumerate(result) if m[0] == mount["containerPath"]]
            if same:  # the first one at that path only, as RemoveMount does
                del result[same[0]]
            result.append((mount["containerPath"], mount["hostPath"]))
        if edits.get("mounts"):
            result.sort(key=lambda m: os.path.normpath(m[0]).count("/"))
    return merged, result


def create_runtime_hooks(
    devices: Sequence[Mapping[str, Any]], env: Mapping[str, str], bundle: Path
) -> list[subprocess.CompletedProcess[str]]:
    """The ``createRuntime`` hooks of these CDI devices (in their order), run as a runtime
    runs them once the container's final ``env`` is in ``<bundle>/config.json``: the OCI
    state on stdin, the hook's args as its argv, its env as its environment. The first
    that fails stops the rest, and the container is not created."""
    bundle.mkdir(parents=True, exist_ok=True)
    config = {"ociVersion": "1.2.0", "process": {"env": [f"{k}={v}" for k, v in env.items()]}}
    (bundle / "config.json").write_text(json.dumps(config))
    state = json.dumps({"ociVersion": "1.2.0", "id": "c1", "status": "creating", "pid": 1,
                        "bundle": str(bundle)})  # fmt: skip
    results = []
    for device in devices:
        for hook in device.get("containerEdits", {}).get("hooks", []):
            if hook["hookName"] != "createRuntime":
                continue
            result = subprocess.run(
                hook.get("args") or [hook["path"]], executable=hook["path"], input=state,
                capture_output=True, text=True,
                env=dict(e.split("=", 1) for e in hook.get("env", [])), timeout=60,
            )  # fmt: skip
            results.append(result)
            if result.returncode != 0:
                return results
    return results
