"""What the DRA driver has prepared, on disk, and the lock that serialises it.

The kubelet's NodeUnprepareResources carries only a claim's namespace, name and UID:
what was made for it (the CDI spec, the cache directories) must be remembered across
daemon restarts. The checkpoint is one JSON file, rewritten whole and atomically
(temporary file, fsync, rename) on every change; an entry is written *before* anything
is made for a claim (state ``preparing``, with the names of what will be made), so a
daemon killed half-way leaves a trail that a later prepare or unprepare cleans up.

Two daemons may run on a node for a moment (a rolling update). :class:`NodeLock` (an
``flock`` on a file beside the checkpoint) is held around every prepare and unprepare,
so their read-modify-write of the checkpoint never interleaves.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

VERSION = 1
PREPARING = "preparing"
PREPARED = "prepared"


@dataclass
class PreparedDevice:
    """One device of a prepared claim, as answered to the kubelet."""

    request: str
    pool: str
    device: str
    cdi_ids: list[str]


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
            devices=[
                PreparedDevice(
                    str(d["request"]), str(d["pool"]), str(d["device"]), list(d["cdi_ids"])
                )
                for d in data.get("devices", [])
            ],
        )


class CheckpointError(Exception):
    """The checkpoint cannot be read or written; one readable line."""


class Checkpoint:
    """Claim UID -> :class:`ClaimEntry`, kept in ``path``. Not thread-safe by itself:
    callers hold :class:`NodeLock`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, ClaimEntry]:
        """The entries on disk; an absent file is empty. A file that is not ours is an
        error (never silently forgotten: unprepare would leak what it names)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CheckpointError(f"cannot read the checkpoint {self.path}: {exc}") from None
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ValueError(f"not a version-{VERSION} checkpoint")
            claims = data.get("claims") or {}
            return {str(uid): ClaimEntry.from_json(entry) for uid, entry in claims.items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"the checkpoint {self.path} is unusable: {exc}") from None

    def save(self, entries: dict[str, ClaimEntry]) -> None:
        document = {
            "version": VERSION,
            "claims": {uid: asdict(entry) for uid, entry in sorted(entries.items())},
        }
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(document, out, indent=1)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class NodeLock:
    """An exclusive lock across the daemons of this node (``flock``) and the threads of
    this one (a mutex: ``flock`` does not exclude two descriptors of one process from
    each other reliably across platforms)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mutex = threading.Lock()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._mutex:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
