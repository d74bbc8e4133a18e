"""Do the CDI names our answers hand out resolve on this node?

With ``--device-list-strategy`` ``cdi-cri`` or ``cdi-annotations`` an answer names
its cards as CDI devices (``nvidia.com/gpu=<UUID>``); the container runtime looks
each name up in the CDI specs of the node (``/etc/cdi`` and ``/var/run/cdi`` by
default, written by ``nvidia-ctk cdi generate`` or the GPU Operator) and refuses to
create a container whose name it cannot find. :class:`CdiCheck` reads those specs
at start and whenever a spec directory changes, and says which names are missing,
so the operator learns it from one log line and ``/readyz`` instead of from every
failed pod.

A spec (CDI specification, ``cdiVersion``/``kind``/``devices[].name``) is a YAML or
JSON file; a device's fully qualified name is ``<kind>=<name>``.

The DRA driver also *writes* specs (:func:`write_spec`): one per prepared claim, whose
devices carry the claim's environment and mounts (the interposer, its limits, the
claim's cache directory).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import yaml

from gpushare.base.atomicfile import replace_file
from gpushare.share.answers import ContainerEdits, DeviceSpec, Hook

log = structlog.get_logger(__name__)

SPEC_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class CdiScan:
    """What the spec directories hold: every fully qualified device name, and the
    files that could not be used (each with why)."""

    names: frozenset[str]
    problems: tuple[str, ...] = ()


def spec_names(data: object) -> set[str]:
    """The fully qualified device names of one parsed spec; ValueError if it is not one."""
    if not isinstance(data, dict):
        raise ValueError("not a mapping")
    kind = data.get("kind")
    devices = data.get("devices")
    if not isinstance(kind, str) or "/" not in kind:
        raise ValueError(f"kind {kind!r} is not <vendor>/<class>")
    if not isinstance(devices, list):
        raise ValueError("no devices list")
    names = set()
    for device in devices:
        name = device.get("name") if isinstance(device, dict) else None
        if isinstance(name, str) and name:
            names.add(f"{kind}={name}")
        elif isinstance(name, int) and not isinstance(name, bool):
            names.add(f"{kind}={name}")  # YAML reads an unquoted index as a number
    return names


def read_specs(directories: Iterable[Path]) -> CdiScan:
    """Every spec file (``*.yaml``, ``*.yml``, ``*.json``) of the directories; a
    missing directory holds nothing, an unreadable file is a problem, not an error."""
    names: set[str] = set()
    problems: list[str] = []
    for directory in directories:
        try:
            files = sorted(p for p in Path(directory).iterdir() if p.suffix in SPEC_SUFFIXES)
        except OSError:
            continue
        for path in files:
            try:
                names |= spec_names(yaml.safe_load(path.read_text()))
            except (OSError, yaml.YAMLError, ValueError, UnicodeDecodeError) as exc:
                problems.append(f"{path}: {str(exc).splitlines()[0] if str(exc) else exc}")
    return CdiScan(frozenset(names), tuple(problems))


def _stamp(directories: Sequence[Path]) -> tuple[tuple[str, int, int], ...]:
    """Names, change times and sizes of the spec files: changes when any spec does."""
    entries = []
    for directory in directories:
        try:
            with os.scandir(directory) as found:
                for entry in found:
                    if entry.name.endswith(SPEC_SUFFIXES):
                        st = entry.stat()
                        entries.append((entry.path, st.st_mtime_ns, st.st_size))
        except OSError:
            continue
    return tuple(sorted(entries))


class CdiCheck:
    """The CDI names we hand out (``wanted``) against the node's specs.

    :meth:`missing` re-reads the specs only when a spec file changed since the last
    look (a directory listing and a stat per file otherwise), and logs once per change
    of the answer: ``cdi_names_unresolved`` with the missing names, or
    ``cdi_names_resolved``.
    """

    def __init__(self, directories: Sequence[Path], wanted: Iterable[str]) -> None:
        self.directories = list(directories)
        self.wanted = sorted(set(wanted))
        self._lock = threading.Lock()
        self._stamp: tuple[tuple[str, int, int], ...] | None = None
        self._missing: list[str] = []

    def missing(self) -> list[str]:
        with self._lock:
            stamp = _stamp(self.directories)
            if stamp == self._stamp:
                return list(self._missing)
            first = self._stamp is None
            self._stamp = stamp
            scan = read_specs(self.directories)
            missing = [name for name in self.wanted if name not in scan.names]
            for problem in scan.problems:
                log.warning("cdi_spec_unreadable", problem=problem)
            if missing:
                log.warning(
                    "cdi_names_unresolved",
                    missing=missing,
                    directories=[str(d) for d in self.directories],
                    hint="run nvidia-ctk cdi generate (or let the GPU Operator), "
                    "or choose --device-list-strategy envvar",
                )
            elif self._missing or first:
                log.info("cdi_names_resolved", names=len(self.wanted))
            self._missing = missing
            return list(missing)


# --------------------------------------------------------------------------- writing

#: The CDI version the claim specs are written in: environment and mounts only, which
#: every CDI-aware runtime (containerd >= 1.7, CRI-O >= 1.23) reads.
CDI_VERSION = "0.5.0"
_CDI_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


@dataclass(frozen=True)
class CdiMount:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class CdiDevice:
    """One device of a spec: its name and the edits it makes to a container."""

    name: str
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[CdiMount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    #: device nodes (a MIG device's capabilities, ``--mig-device-specs``)
    device_nodes: tuple[DeviceSpec, ...] = ()


def claim_device(name: str, edits: ContainerEdits) -> CdiDevice:
    """The CDI device ``name`` carrying ``edits`` (from the answer port): its
    environment (sorted), mounts, hooks and device nodes; a translation, nothing added."""
    return CdiDevice(
        name,
        env=tuple(sorted(edits.envs.items())),
        mounts=tuple(CdiMount(m.container_path, m.host_path, m.read_only) for m in edits.mounts),
        hooks=tuple(edits.hooks),
        device_nodes=tuple(edits.device_specs),
    )


def spec_file_name(kind: str, name: str) -> str:
    """``<vendor>-<class>_<name>.json``: the file of one spec (the name must be safe)."""
    if not _CDI_NAME.match(name) or "/" in name:
        raise ValueError(f"{name!r} is not a safe CDI spec name")
    return f"{kind.replace('/', '-')}_{name}.json"


def spec_json(kind: str, devices: Sequence[CdiDevice]) -> dict[str, object]:
    """The CDI spec document for ``devices`` of ``kind`` (``vendor/class``)."""
    if "/" not in kind:
        raise ValueError(f"kind {kind!r} is not <vendor>/<class>")
    entries = []
    for device in devices:
        if not _CDI_NAME.match(device.name):
            raise ValueError(f"{device.name!r} is not a CDI device name")
        edits: dict[str, object] = {}
        if device.env:
            edits["env"] = [f"{k}={v}" for k, v in device.env]
        if device.mounts:
            edits["mounts"] = [
                {
                    "hostPath": m.host_path,
                    "containerPath": m.container_path,
                    "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "rbind"],
                }
                for m in device.mounts
            ]
        if device.hooks:
            edits["hooks"] = [
                {
                    "hookName": h.hook_name,
                    "path": h.path,
                    **({"args": list(h.args)} if h.args else {}),
                    **({"env": list(h.env)} if h.env else {}),
                }
                for h in device.hooks
            ]
        if device.device_nodes:
            edits["deviceNodes"] = [
                {"path": d.container_path, "hostPath": d.host_path, "permissions": d.permissions}
                for d in device.device_nodes
            ]
        entries.append({"name": device.name, "containerEdits": edits})
    return {"cdiVersion": CDI_VERSION, "kind": kind, "devices": entries}


def write_spec(directory: Path, kind: str, name: str, devices: Sequence[CdiDevice]) -> Path:
    """Write one spec atomically (a temporary file in the same directory, renamed over):
    the runtime never reads half a spec (not fsynced: see ``dra/checkpoint.py``). The
    directory is created (0755) if missing; the file is 0644 and never followed if a
    link stands in its place (the rename replaces the link itself)."""
    return write_spec_document(directory, kind, name, spec_json(kind, devices))


def write_spec_document(
    directory: Path, kind: str, name: str, document: Mapping[str, object]
) -> Path:
    """Write the spec ``document`` (made by :func:`spec_json`, or kept from it and read
    back) as :func:`write_spec` does: the same document gives the same bytes, so a spec
    lost with its tmpfs is written again exactly as it was (``dra/rebuild.py``)."""
    if document.get("kind") != kind:
        raise ValueError(f"the spec document is of kind {document.get('kind')!r}, not {kind!r}")
    target = directory / spec_file_name(kind, name)
    replace_file(target, json.dumps(document).encode(), 0o644, dir_mode=0o755)
    return target


def remove_spec(directory: Path, kind: str, name: str) -> bool:
    """Remove one spec written by :func:`write_spec`; True if it was there."""
    try:
        (directory / spec_file_name(kind, name)).unlink()
    except FileNotFoundError:
        return False
    return True
