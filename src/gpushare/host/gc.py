"""Garbage collection of what Allocate leaves on the host.

Two kinds of leftovers, both under ``--host-lib-dir``:

* **Per-container records and cache directories** (``containers/<key>.json`` and
  ``containers/<key>/``). The key is derived from the exact set of units a container
  holds, so a record is in use exactly while some container in the kubelet's
  PodResources list holds that set. A record is removed once it has been missing
  from every successful read for longer than the grace period, counted from the
  later of its creation and the first read that missed it (a restarted daemon waits
  a full grace period again). Under the lock that Allocate holds while preparing a
  directory, the record is re-read (a container given the same units again keeps its
  fresh directory), removed, and the directory *buried*: renamed into the trash, one
  rename whatever a tenant built in it. The reaper thread deletes it afterwards,
  outside the lock (``tombstones.py``). Each pass also measures every cache
  directory with bounded work (``diskuse.py``), for ``gpushare_cache_dir_bytes`` and a
  ``cache_dir_over_limit`` line, and repairs the lock directory if a tenant changed it.
  The DRA driver's claim cache directories (``d-<key>``) are measured and bounded the
  same way (they share the bounded file system), named by their claim
  (:attr:`CacheDirSizes.claim_holders`); they are never collected here: the DRA
  driver removes them when the kubelet unprepares their claim.
* **Old versioned interposer files** (``libvgpu.so.<hash>`` and its
  ``ld.so.preload.<hash>``). A container mounts the version that was current when it
  was allocated. The daemon cannot look into other containers' mounts
  (``/proc/<pid>/mountinfo`` of the node's processes is not visible from its pod),
  and writing a record per Allocate only for this would cost every core Allocate a
  file write. Instead a version is *retired* the first time a collection finds it is
  no longer the current one: the containers alive at that moment (from the same
  successful PodResources read) are written beside it in ``libraries.json``. Every
  container allocated later got a newer version, so the old one is removed once
  none of those containers remains and the grace period has passed since it was
  retired. A lost or unreadable ``libraries.json`` retires every old version again
  (it only delays removal).

Collection only ever runs after a successful PodResources read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gpushare.host.cachefs import bound
from gpushare.host.diskuse import Usage, measure
from gpushare.host.grantspecs import GrantSpecs, exclusive_grant_name, grant_name
from gpushare.host.library import (
    CACHE_LOCK,
    LIBRARY_NAME,
    LOCK_DIR_NAME,
    cache_key,
    cache_root,
    ensure_lock_dir,
)
from gpushare.host.tombstones import bury, wake
from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder

log = structlog.get_logger(__name__)

_KEY = re.compile(r"^c-[0-9a-f]{20}$")
_CLAIM_KEY = re.compile(r"^d-[0-9a-f]{20}$")
RETIRED_FILE = "libraries.json"
_VERSIONED = re.compile(r"^(?:" + re.escape(LIBRARY_NAME) + r"|ld\.so\.preload)\.([0-9a-f]{12})$")


@dataclass
class Collected:
    """What one collection removed."""

    records: list[str] = field(default_factory=list)
    libraries: list[str] = field(default_factory=list)
    specs: list[str] = field(default_factory=list)  # per-grant CDI specs


def live_keys(snapshot: Snapshot) -> set[str]:
    """The cache keys of every container the kubelet reports holding memory units."""
    return {
        cache_key(by_resource[Resource.MEMORY])
        for by_resource in snapshot.devices.values()
        if by_resource.get(Resource.MEMORY)
    }


def live_grants(snapshot: Snapshot) -> set[str]:
    """The per-grant CDI spec names (``host/grantspecs.py``) of every holding listed:
    shared units per container and resource, and each container's devices of an
    exclusive resource (whole cards, MIG devices, time-sliced replicas)."""
    live = {
        grant_name(resource.value, ids)
        for by_resource in snapshot.devices.values()
        for resource, ids in by_resource.items()
        if ids
    }
    for full_name, holders in snapshot.exclusive.items():
        held: dict[Holder, list[str]] = {}
        for device_id, holder in holders.items():
            held.setdefault(holder, []).append(device_id)
        live.update(exclusive_grant_name(full_name, ids) for ids in held.values())
    return live


def holder_keys(snapshot: Snapshot) -> set[str]:
    """One string per container holding our units: who it is and exactly what it holds
    (a pod re-created under the same name with other units is another container)."""
    keys = set()
    for holder, by_resource in snapshot.devices.items():
        held = sorted(f"{r.value}={d}" for r, ids in by_resource.items() for d in ids)
        digest = hashlib.sha256("\n".join(held).encode()).hexdigest()[:16]
        keys.add(f"{holder.namespace}/{holder.pod}/{holder.container}/{digest}")
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
        size_limit_bytes: int | None = None,
        lock_dir: bool = False,
        on_pass: Callable[[], object] | None = None,
        grant_specs: GrantSpecs | None = None,
    ) -> None:
        self.host_dir = host_dir
        #: the device plugin's per-grant CDI specs (under a CDI strategy), collected too
        self.grant_specs = grant_specs
        self.root = cache_root(host_dir)
        #: every cache directory measured at each pass
        self.sizes = CacheDirSizes(host_dir, size_limit_bytes)
        #: the old interposer versions, retired and removed
        self.libraries = RetiredLibraries(host_dir, current_library, grace_seconds, clock)
        self._check_lock_dir = lock_dir
        self._on_pass = on_pass
        self.grace_seconds = grace_seconds
        self._clock = clock
        # key -> when its grace period started: the later of its record's creation and
        # the first pass that found no container holding it
        self._waiting_from: dict[str, float] = {}
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
        keys, claim_keys = self._keys_on_disk()
        for key in list(self._waiting_from):
            if key not in keys or key in live:
                del self._waiting_from[key]
        for key in sorted(keys - live):
            waiting_from = self._waiting_from.get(key)
            if waiting_from is None:  # read once per absence: a busy node has thousands
                waiting_from = self._waiting_from[key] = max(now, self._created(key))
            if now - waiting_from <= self.grace_seconds:
                continue
            removed, waiting_from = self._remove(key, waiting_from, now)
            if removed:
                collected.records.append(key)
                del self._waiting_from[key]
            else:
                self._waiting_from[key] = waiting_from
        collected.libraries = self.libraries.collect(snapshot)
        if self.grant_specs is not None:
            collected.specs = self.grant_specs.collect(live_grants(snapshot), now)
        self.sizes.measure((keys - set(collected.records)) | claim_keys, snapshot)
        if self._check_lock_dir:
            ensure_lock_dir(self.host_dir)
        self.sizes.log_bound_once()
        if self._on_pass is not None:
            self._on_pass()
        return collected

    def _keys_on_disk(self) -> tuple[set[str], set[str]]:
        """The device plugin's keys (collected here), and the DRA driver's claim keys
        (only measured)."""
        try:
            names = [entry.name for entry in self.root.iterdir()]
        except OSError:
            return set(), set()
        keys, claim_keys = set(), set()
        for name in names:
            key = name.removesuffix(".json")
            if _KEY.match(key):
                keys.add(key)
            elif _CLAIM_KEY.match(name):
                claim_keys.add(name)
        return keys, claim_keys

    def _created(self, key: str) -> float:
        record = _read_record(self.root / f"{key}.json")
        created = record.get("created") if record else None
        if isinstance(created, int | float):
            return float(created)
        return self._mtime(key)

    def _mtime(self, key: str) -> float:
        times = []
        for path in (self.root / key, self.root / f"{key}.json"):
            with contextlib.suppress(OSError):
                times.append(path.stat().st_mtime)
        return max(times, default=0.0)

    def _remove(self, key: str, waiting_from: float, now: float) -> tuple[bool, float]:
        """Remove the entry if its grace period is still over once its record is read
        again under the lock; else (False, when the grace period now starts)."""
        record_file = self.root / f"{key}.json"
        with CACHE_LOCK:
            record = _read_record(record_file)
            created = record.get("created") if record else None
            if isinstance(created, int | float) and created > waiting_from:
                waiting_from = float(created)  # prepared again for a new container
            if now - waiting_from <= self.grace_seconds:
                return False, waiting_from
            # The record goes first and the directory last, so that a directory seen
            # gone means the whole entry is gone. A directory left behind by a failure
            # in between is still a key on disk and is collected on a later pass.
            try:
                record_file.unlink(missing_ok=True)
                tombstone = bury(self.root, key) if os.path.lexists(self.root / key) else None
            except OSError as exc:
                log.warning("cache_dir_not_removed", key=key, error=str(exc))
                return False, waiting_from
        if tombstone is not None:
            wake(self.root)  # the reaper deletes it, outside the lock
        log.info(
            "cache_dir_removed",
            key=key,
            device_ids=(record or {}).get("device_ids", []),
            grace_seconds=self.grace_seconds,
            tombstone=tombstone,
        )
        return True, waiting_from

class CacheDirSizes:
    """Every cache directory (the device plugin's, the DRA driver's claims', the lock
    directory) measured at each pass with bounded work (``diskuse.py``); each one past
    ``size_limit_bytes`` logged once, with its holder; and, once, what bounds the space
    tenants can write."""

    def __init__(self, host_dir: Path, size_limit_bytes: int | None) -> None:
        self.host_dir = host_dir
        self.root = cache_root(host_dir)
        self.size_limit_bytes = size_limit_bytes
        # key -> its last measurement; keys over the limit were logged once
        self.usage: dict[str, Usage] = {}
        self._over_limit: set[str] = set()
        self._bound_logged = False
        #: Claim cache key -> who holds it ("claim <namespace>/<name>"), from the DRA
        #: driver when there is one: names the claim in ``cache_dir_over_limit``.
        self.claim_holders: Callable[[], dict[str, str]] | None = None

    def name_claim_holders_with(self, holders: Callable[[], dict[str, str]]) -> None:
        """The DRA driver serves: ``holders`` answers claim cache key -> its holder."""
        self.claim_holders = holders

    def log_bound_once(self) -> None:
        if not self._bound_logged:
            self._bound_logged = True
            self._log_bound()

    def _log_bound(self) -> None:
        """Say once what bounds the space tenants can write (host/cachefs.py)."""
        found = bound(self.host_dir)
        if found is None:
            return
        if found.own:
            log.info(
                "cache_fs_bounded",
                fs_type=found.fs_type,
                size_bytes=found.size_bytes,
                free_bytes=found.free_bytes,
            )
        else:
            log.warning(
                "cache_fs_unbounded",
                path=str(self.root),
                shared_fs_bytes=found.size_bytes,
                remedy="run the DaemonSet's cache-fs init container (docs/security.md)",
            )

    def measure(self, keys: set[str], snapshot: Snapshot) -> None:
        """Measure every cache directory; log each one that passes the limit, once."""
        usage: dict[str, Usage] = {}
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            for key in sorted(keys):
                usage[key] = measure(root_fd, key)
            if os.path.lexists(self.root / LOCK_DIR_NAME):  # shared: measured too
                usage[LOCK_DIR_NAME] = measure(root_fd, LOCK_DIR_NAME)
        finally:
            os.close(root_fd)
        self.usage = usage
        limit = self.size_limit_bytes
        if limit is None:
            return
        holders = {
            cache_key(by_resource[Resource.MEMORY]): f"{h.namespace}/{h.pod}/{h.container}"
            for h, by_resource in snapshot.devices.items()
            if by_resource.get(Resource.MEMORY)
        }
        over = {key for key, used in usage.items() if used.bytes > limit}
        if over - self._over_limit and self.claim_holders is not None:
            holders.update(self.claim_holders())
        for key in sorted(over - self._over_limit):
            used, holder = usage[key], holders.get(key)
            log.warning(
                "cache_dir_over_limit",
                key=key,
                bytes=used.bytes,
                limit_bytes=limit,
                entries=used.entries,
                measured_completely=used.complete,
                holder=holder,
            )
        self._over_limit = over

    def total_cache_bytes(self) -> int:
        """Bytes of every cache directory at the last pass (a lower bound, see diskuse)."""
        return sum(used.bytes for used in self.usage.values())

    @property
    def over_limit(self) -> int:
        return len(self._over_limit)


class RetiredLibraries:
    """Old versioned interposer files: retired the first time a pass finds they are no
    longer current (with the containers alive then, in ``libraries.json``), removed once
    none of those remains and the grace period has passed."""

    def __init__(
        self,
        host_dir: Path,
        current_library: Path | None,
        grace_seconds: float,
        clock: Callable[[], float],
    ) -> None:
        self.host_dir = host_dir
        self.current_library = current_library
        self.grace_seconds = grace_seconds
        self._clock = clock

    def _load(self) -> dict[str, dict[str, Any]]:
        data = _read_record(self.host_dir / RETIRED_FILE)
        if data is None:
            return {}
        return {
            name: entry
            for name, entry in data.items()
            if isinstance(entry, dict)
            and isinstance(entry.get("retired_at"), int | float)
            and isinstance(entry.get("holders"), list)
        }

    def collect(self, snapshot: Snapshot) -> list[str]:
        """One pass against a fresh, successful PodResources read: the files removed."""
        removed: list[str] = []
        current = None
        if self.current_library is not None:
            match = _VERSIONED.match(self.current_library.name)
            current = match.group(1) if match else None
        try:
            names = [path.name for path in self.host_dir.iterdir()]
        except OSError:
            return removed
        old_versions: dict[str, list[str]] = {}
        for name in names:
            match = _VERSIONED.match(name)
            if match is not None and match.group(1) != current:
                old_versions.setdefault(match.group(1), []).append(name)
        retired = self._load()
        now = self._clock()
        alive = holder_keys(snapshot)
        changed = False
        for version in list(retired):
            if version not in old_versions:
                del retired[version]  # removed, or current again
                changed = True
        for version, files in sorted(old_versions.items()):
            entry = retired.get(version)
            if entry is None:
                retired[version] = {"retired_at": now, "holders": sorted(alive)}
                changed = True
                log.info("library_retired", version=version, containers=len(alive))
                continue
            holders = [h for h in entry["holders"] if h in alive]
            if holders != entry["holders"]:
                entry["holders"] = holders
                changed = True
            if holders or now - float(entry["retired_at"]) <= self.grace_seconds:
                continue
            for name in files:
                path = self.host_dir / name
                try:
                    path.unlink()
                except OSError as exc:
                    log.warning("library_not_removed", path=str(path), error=str(exc))
                    continue
                removed.append(name)
                log.info("old_library_removed", path=str(path))
            del retired[version]
            changed = True
        if changed:
            self._save(retired)
        return removed

    def _save(self, retired: dict[str, dict[str, Any]]) -> None:
        target = self.host_dir / RETIRED_FILE
        tmp = target.with_name(f".{RETIRED_FILE}.tmp")
        try:
            tmp.write_text(json.dumps(retired, sort_keys=True))
            tmp.replace(target)
        except OSError as exc:
            log.warning("library_state_not_saved", path=str(target), error=str(exc))


class CacheDirMetrics:
    """The collector's figures as Prometheus gauges (register it in a registry)."""

    def __init__(self, sizes: CacheDirSizes) -> None:
        self._sizes = sizes

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily(
            "gpushare_cache_dir_bytes",
            "Bytes on disk of the per-container and per-claim (DRA) cache directories and "
            "the lock directory at the last GC pass (a lower bound for a tree too large "
            "to measure)",
            value=self._sizes.total_cache_bytes(),
        )
        yield GaugeMetricFamily(
            "gpushare_cache_dirs_over_limit",
            "Cache directories larger than --cache-dir-limit-mib at the last GC pass",
            value=self._sizes.over_limit,
        )
