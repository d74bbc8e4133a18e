"""What the DRA driver has prepared, on disk, and the lock that serialises it.

The kubelet's NodeUnprepareResources carries only a claim's namespace, name and UID:
what was made for it (the CDI spec, the cache directory) must be remembered across
daemon restarts. The checkpoint holds one small JSON file per prepared claim, written
atomically once everything for the claim is made. A daemon killed half-way leaves
things no entry names: they are removed at the next start (``ClaimPreparer.tidy``),
and a prepare retried by the kubelet makes everything afresh.

Two daemons may run on a node for a moment (a rolling update). :class:`NodeLock` (an
``flock`` on a file beside the checkpoint) is held around every prepare and unprepare,
so their read-modify-write of the checkpoint never interleaves.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gpushare.base.atomicfile import replace_file

log = structlog.get_logger(__name__)

VERSION = 1
PREPARED = "prepared"


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
        )


class CheckpointError(Exception):
    """A checkpoint entry cannot be read or written; one readable line."""


class Checkpoint:
    """Claim UID -> :class:`ClaimEntry`, one file per claim in ``directory``
    (``<uid>.json``): a prepare writes one small file whatever the number of claims on
    the node, and an unreadable file loses one claim's record, not every claim's. Not
    thread-safe by itself: callers hold :class:`NodeLock`.

    Files are replaced atomically (temporary file, rename) but not fsynced: a killed
    daemon loses nothing (the page cache outlives it); after a power loss the node's
    containers are gone too, and what a lost entry named is removed at the next start
    (:meth:`gpushare.dra.claims.ClaimPreparer.tidy`)."""

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
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read the checkpoint {path}: {exc}") from None
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ValueError(f"not a version-{VERSION} entry")
            return ClaimEntry.from_json(data.get("claim"))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"the checkpoint {path} is unusable: {exc}") from None

    def put(self, uid: str, entry: ClaimEntry) -> None:
        path = self._path(uid)
        data = json.dumps({"version": VERSION, "claim": asdict(entry)}).encode()
        replace_file(path, data, 0o600, dir_mode=0o700)

    def delete(self, uid: str) -> None:
        self._path(uid).unlink(missing_ok=True)

    def uids(self) -> list[str]:
        try:
            names = [p.name for p in self.directory.iterdir()]
        except FileNotFoundError:
            return []
        return sorted(n[: -len(".json")] for n in names if n.endswith(".json") and n[0] != ".")


class NodeLock:
    """An exclusive lock across the daemons of this node (``flock``) and the threads of
    this one (a mutex: ``flock`` does not exclude two descriptors of one process from
    each other reliably across platforms)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mutex = threading.Lock()
        self._fd: int | None = None  # opened once, on first use

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._mutex:
            if self._fd is None:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                self._fd = os.open(self.path, flags, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self._mutex:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
