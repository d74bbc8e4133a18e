"""Garbage collection of what Allocate leaves on the host.

Two kinds of leftovers, both under ``--host-lib-dir``:

* **Per-container records and cache directories** (``containers/<key>.json`` and
  ``containers/<key>/``). The key is derived from the exact set of units a container
  holds, so a record is in use exactly while some container in the kubelet's
  PodResources list holds that set. A record is removed once it has been missing
  from every successful read for longer than the grace period, counted from the
  later of its creation and the first read that missed it (a restarted daemon waits
  a full grace period again). Removal happens under the same lock that Allocate
  holds while preparing a directory, and is skipped if the record changed since it
  was read: a container given the same units again keeps its fresh directory.
* **Old versioned interposer files** (``libvgpu.so.<hash>`` and its
  ``ld.so.preload.<hash>``). A container mounts the library that was current when it
  was allocated; every record names that file. A version is kept while it is the
  current one or any remaining record names it, and records outlive their containers
  (above), so a library is never removed under a running container. A record that
  does not name its library (unreadable, or written by an older gpushare) keeps
  every version until it is itself collected. The daemon cannot look into other
  containers' mounts (``/proc/<pid>/mountinfo`` of the node's processes is not
  visible from its pod), so the records are the evidence.

Collection only ever runs after a successful PodResources read.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gpushare.devices import Resource
from gpushare.library import (
    CACHE_LOCK,
    CACHE_ROOT_NAME,
    LIBRARY_NAME,
    cache_key,
    library_record_key,
)
from gpushare.podresources import Snapshot

log = structlog.get_logger(__name__)

_KEY = re.compile(r"^[cl]-[0-9a-f]{20}$")
_VERSIONED = re.compile(r"^(?:" + re.escape(LIBRARY_NAME) + r"|ld\.so\.preload)\.([0-9a-f]{12})$")


@dataclass
class Collected:
    """What one collection removed (and whether it had to keep every library)."""

    records: list[str] = field(default_factory=list)
    libraries: list[str] = field(default_factory=list)
    kept_all_libraries: bool = False


def live_keys(snapshot: Snapshot) -> set[str]:
    """The record keys of every container the kubelet reports holding our units."""
    keys: set[str] = set()
    for by_resource in snapshot.devices.values():
        memory = by_resource.get(Resource.MEMORY)
        if memory:
            keys.add(cache_key(memory))
        core = by_resource.get(Resource.CORE)
        if core:
            keys.add(library_record_key(core))
    return keys


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class GarbageCollector:
    """Removes stale per-container records, cache directories and library versions."""

    def __init__(
        self,
        host_dir: Path,
        grace_seconds: float,
        current_library: Path | None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.host_dir = host_dir
        self.root = host_dir / CACHE_ROOT_NAME
        self.grace_seconds = grace_seconds
        self.current_library = current_library
        self._clock = clock
        self._missing_since: dict[str, float] = {}
        self._last_run: float | None = None

    def maybe_collect(self, snapshot: Snapshot) -> Collected | None:
        """Collect, at most about twice per grace period (and at least every minute)."""
        now = self._clock()
        spacing = min(self.grace_seconds / 2, 60.0)
        if self._last_run is not None and now - self._last_run < spacing:
            return None
        return self.collect(snapshot)

    def collect(self, snapshot: Snapshot) -> Collected:
        """One pass against a fresh, successful PodResources read."""
        now = self._clock()
        self._last_run = now
        collected = Collected()
        live = live_keys(snapshot)
        keys = self._keys_on_disk()
        for key in list(self._missing_since):
            if key not in keys or key in live:
                del self._missing_since[key]
        for key in sorted(keys - live):
            missing_since = self._missing_since.setdefault(key, now)
            record = _read_record(self.root / f"{key}.json")
            created = record.get("created") if record else None
            if not isinstance(created, int | float):
                created = self._mtime(key)
            if now - max(float(created), missing_since) <= self.grace_seconds:
                continue
            if self._remove(key, created):
                del self._missing_since[key]
                collected.records.append(key)
        self._collect_libraries(collected)
        return collected

    def _keys_on_disk(self) -> set[str]:
        try:
            names = [entry.name for entry in self.root.iterdir()]
        except OSError:
            return set()
        keys = set()
        for name in names:
            key = name.removesuffix(".json")
            if _KEY.match(key):
                keys.add(key)
        return keys

    def _mtime(self, key: str) -> float:
        times = []
        for path in (self.root / key, self.root / f"{key}.json"):
            with contextlib.suppress(OSError):
                times.append(path.stat().st_mtime)
        return max(times, default=0.0)

    def _remove(self, key: str, created: float) -> bool:
        record_file = self.root / f"{key}.json"
        with CACHE_LOCK:
            record = _read_record(record_file)
            now_created = record.get("created") if record else None
            if isinstance(now_created, int | float) and now_created != created:
                return False  # prepared again for a new container since we looked
            shutil.rmtree(self.root / key, ignore_errors=True)
            try:
                record_file.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cache_record_not_removed", key=key, error=str(exc))
                return False
        log.info(
            "cache_dir_removed",
            key=key,
            device_ids=(record or {}).get("device_ids", []),
            grace_seconds=self.grace_seconds,
        )
        return True

    def _collect_libraries(self, collected: Collected) -> None:
        in_use: set[str] = set()
        if self.current_library is not None:
            in_use.add(self.current_library.name)
        for key in self._keys_on_disk():
            record = _read_record(self.root / f"{key}.json")
            library = record.get("library") if record else None
            if not isinstance(library, str) or not library:
                collected.kept_all_libraries = True
                return
            in_use.add(library)
        versions_in_use = {
            match.group(1) for name in in_use if (match := _VERSIONED.match(name)) is not None
        }
        try:
            files = list(self.host_dir.iterdir())
        except OSError:
            return
        for path in files:
            match = _VERSIONED.match(path.name)
            if match is None or match.group(1) in versions_in_use:
                continue
            try:
                path.unlink()
            except OSError as exc:
                log.warning("library_not_removed", path=str(path), error=str(exc))
                continue
            collected.libraries.append(path.name)
            log.info("old_library_removed", path=str(path))
