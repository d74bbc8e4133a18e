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
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import yaml

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
