"""What the DRA driver has prepared, on disk, and the lock that serialises it.

The kubelet's NodeUnprepareResources carries only a claim's namespace, name and UID:
what was made for it (the CDI spec, the cache directory) must be remembered across
daemon restarts. The checkpoint holds one small JSON file per prepared claim, written
atomically and durably (fsynced, then its directory) once everything for the claim is
made. What no entry names is sorted out at the next start (``ClaimPreparer.tidy``): a
claim's CDI spec is kept (a container may run with it) and its entry recovered from
it; a cache directory no entry or spec names was never handed to a container and goes.
An entry that cannot be read (torn by a power cut, or not ours) is set aside and
recovered the same way, for that claim alone.

Two daemons may run on a node for a moment (a rolling update). :class:`NodeLock` (an
``flock`` on a file beside the checkpoint) is held around every prepare and unprepare,
so their read-modify-write of the checkpoint never interleaves.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import structlog

from gpushare.base.atomicfile import read_small_file, replace_file, sync_directory

log = structlog.get_logger(__name__)

VERSION = 1
PREPARED = "prepared"
#: An entry rebuilt from a claim's CDI spec (its own entry lost or unreadable): what it
#: names is kept until the kubelet unprepares the claim, and a prepare of the claim
#: makes it afresh from the API server, keeping its cache directories.
RECOVERED = "recovered"
#: The largest entry read (a real one is well under 4 KiB).
MAX_ENTRY_BYTES = 1 << 20


@dataclass
class PreparedDevice:
    """One device of a prepared claim, as answered to the kubelet, and what it holds.

    ``card`` (the physical card's UUID, a MIG device's parent), ``mig`` (a MIG device's
    UUID, served whole), ``memory_mib`` (the limit enforced: the rounded
    ``consumedCapacity``, a MIG device's memory) and ``cores`` (0: no core limit) were
    added later: an entry written before says nothing of them (None, "")."""

    request: str
    pool: str
    device: str
    cdi_ids: list[str]
    card: str = ""
    mig: str = ""
    memory_mib: int | None = None
    cores: int | None = None

    @staticmethod
    def from_json(data: Any) -> PreparedDevice:
        if not isinstance(data, dict):
            raise ValueError("a prepared device is not a mapping")
        return PreparedDevice(
            str(data["request"]),
            str(data["pool"]),
            str(data["device"]),
            [str(i) for i in data["cdi_ids"]],
            card=str(data.get("card") or ""),
            mig=str(data.get("mig") or ""),
            memory_mib=_count(data.get("memory_mib")),
            cores=_count(data.get("cores")),
        )


def _count(value: Any) -> int | None:
    """A non-negative whole number as written, or None (absent or not one)."""
    return value if type(value) is int and value >= 0 else None


@dataclass
class ClaimEntry:
    namespace: str
    name: str
    state: str
    spec_name: str  # the CDI spec's name (its file is derived from it)
    cache_keys: list[str] = field(default_factory=list)
    devices: list[PreparedDevice] = field(default_factory=list)
    #: The limits its CDI spec sets for every index (issue 32 item 2): the smallest
    #: memory share (MiB) and core share (100: none) among the claim and every claim
    #: it shares a container with. None: it sets none, or an entry written before.
    memory_limit_mib: int | None = None
    core_limit: int | None = None
    #: Mate UID -> [MiB, cores]: the smallest shares of a container this claim shares
    #: with a claim not prepared yet, which that claim must not exceed when it is.
    held_with: dict[str, list[int]] = field(default_factory=dict)
    #: The claim's CDI spec as written (``host/cdi.spec_json``), and what its results
    #: made on the host (``host/grants.needs_record``): a prepare that finds them gone
    #: (a reboot empties ``/var/run/cdi`` and the cache tmpfs) makes them again, the
    #: same (``dra/rebuild.py``). None / []: an entry written before, or a claim whose
    #: host side is not kept here (a recovered one).
    spec: dict[str, Any] | None = None
    made: list[dict[str, Any]] = field(default_factory=list)

    @staticmethod
    def from_json(data: Any) -> ClaimEntry:
        if not isinstance(data, dict):
            raise ValueError("a claim entry is not a mapping")
        return ClaimEntry(
            namespace=str(data["namespace"]),
            name=str(data["name"]),
            state=str(data["state"]),
            spec_name=str(data["spec_name"]),
            cache_keys=[str(k) for k in data.get("cache_keys", [])],
            devices=[PreparedDevice.from_json(d) for d in data.get("devices", [])],
            memory_limit_mib=_count(data.get("memory_limit_mib")),
            core_limit=_count(data.get("core_limit")),
            held_with=_floors(data.get("held_with")),
            spec=data["spec"] if isinstance(data.get("spec"), dict) else None,
            made=[m for m in data.get("made") or () if isinstance(m, dict)],
        )


def _floors(value: Any) -> dict[str, list[int]]:
    """``held_with`` as written; what is not a pair of counts is left out."""
    if not isinstance(value, dict):
        return {}
    pairs = {str(k): v for k, v in value.items() if isinstance(v, list) and len(v) == 2}
    return {k: [v[0], v[1]] for k, v in pairs.items() if all(_count(x) is not None for x in v)}


class CheckpointError(Exception):
    """A checkpoint entry cannot be read or written; one readable line."""


class Checkpoint:
    """Claim UID -> :class:`ClaimEntry`, one file per claim in ``directory``
    (``<uid>.json``): a prepare writes one small file whatever the number of claims on
    the node, and an unreadable file loses one claim's record, not every claim's. Not
    thread-safe by itself: callers hold :class:`NodeLock`.

    Files are replaced atomically and durably (temporary file fsynced, rename, the
    directory fsynced): after a power cut an entry is the old one or the new one. An
    entry that still cannot be read (not ours, or a file system that lost it anyway)
    raises :class:`CheckpointError` for its claim alone, and :meth:`set_aside` moves it
    out of the way. Reads never follow a link, never block (a FIFO is refused) and
    are bounded (:data:`MAX_ENTRY_BYTES`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, uid: str) -> Path:
        if not uid or "/" in uid or uid.startswith("."):
            raise CheckpointError(f"{uid[:80]!r} is not a claim UID")
        return self.directory / f"{uid}.json"

    def get(self, uid: str) -> ClaimEntry | None:
        """The entry of ``uid``; None if there is none. An entry that is not ours is
        an error (never silently forgotten: unprepare would leak what it names)."""
        path = self._path(uid)
        try:
            text = read_small_file(path, MAX_ENTRY_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read the checkpoint {path}: {exc}") from None
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ValueError(f"not a version-{VERSION} entry")
            return ClaimEntry.from_json(data.get("claim"))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise CheckpointError(f"the checkpoint {path} is unusable: {str(exc)[:200]}") from None

    def put(self, uid: str, entry: ClaimEntry) -> None:
        path = self._path(uid)
        data = json.dumps({"version": VERSION, "claim": _plain(entry)}).encode()
        replace_file(path, data, 0o600, dir_mode=0o700, durable=True)

    def delete(self, uid: str) -> None:
        self._path(uid).unlink(missing_ok=True)

    def set_aside(self, uid: str) -> str:
        """Move an unreadable entry out of the way (renamed ``<uid>.json.unusable``, one
        per claim, kept for a look; a directory or a FIFO there is moved the same way,
        never opened); the name it now has, or "" if nothing was there."""
        path = self._path(uid)
        aside = path.with_name(f"{path.name}.unusable")
        try:
            if os.path.isdir(aside) and not os.path.islink(aside):
                aside = path.with_name(f"{path.name}.unusable.{os.getpid()}")
            os.replace(path, aside)
        except FileNotFoundError:
            return ""
        sync_directory(self.directory)
        return aside.name

    def uids(self) -> list[str]:
        try:
            names = [p.name for p in self.directory.iterdir()]
        except FileNotFoundError:
            return []
        return sorted(n[: -len(".json")] for n in names if n.endswith(".json") and n[0] != ".")


class LockTimeout(Exception):
    """The node lock was not free before the caller's deadline."""


def _plain(entry: ClaimEntry) -> dict[str, Any]:
    """``dataclasses.asdict(entry)``, without its deep copy (on the prepare path): the
    entry's fields, its devices' fields."""
    data = {f.name: getattr(entry, f.name) for f in fields(entry)}
    data["devices"] = [{f.name: getattr(d, f.name) for f in fields(d)} for d in entry.devices]
    return data


class NodeLock:
    """An exclusive lock across the daemons of this node (``flock``) and the threads of
    this one (a mutex: ``flock`` does not exclude two descriptors of one process from
    each other reliably across platforms). :meth:`held` takes a deadline (the
    kubelet's, of the call waiting for it): past it, :class:`LockTimeout`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mutex = threading.Lock()
        self._fd: int | None = None  # opened once, on first use

    @contextlib.contextmanager
    def held(self, deadline: float | None = None) -> Iterator[None]:
        """Hold the lock; ``deadline`` (``time.monotonic()``) bounds the wait."""
        if deadline is None:
            self._mutex.acquire()
        elif not self._mutex.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise LockTimeout("another prepare or unprepare holds the node lock")
        try:
            fd = self._open()
            self._flock(fd, deadline)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(self.path, flags, 0o600)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(f"{self.path} is not a regular file")
            self._fd = fd
        return self._fd

    @staticmethod
    def _flock(fd: int, deadline: float | None) -> None:
        if deadline is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        pause = 0.005  # only while another daemon (a rolling update) holds it
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeout("another daemon holds the node lock")
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.1)

    def close(self) -> None:
        with self._mutex:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
