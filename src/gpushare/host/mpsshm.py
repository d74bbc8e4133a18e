"""The ``/dev/shm`` that MPS servers and their clients share: bounded, measured, swept.

Every client on an ``mps`` card mounts ``<host-lib-dir>/mps/shm`` read-write at its
``/dev/shm`` (MPS passes work through shared memory: the client and the server must see
one directory), and so do the MPS control daemon and servers (the DaemonSet mounts it at
the daemon's own ``/dev/shm``). What is written there is the CUDA driver's
(``cuda.shm.<pid>.<n>`` segments, named after the process that made them, which a
crashed process leaves behind) and whatever a tenant writes: before, a host directory
on the node's disk, unbounded, never measured, its files outliving pods and both
daemons' restarts (issue 41 item 2). Now:

* **bounded**: the DaemonSet's ``cache-fs`` init container mounts a size-limited tmpfs
  there (``nosuid,nodev,noexec``, mode 1777; :func:`gpushare.host.cachefs.mount_shm_fs`),
  as it does over the cache directories, so a tenant filling it gets ``ENOSPC`` and
  nothing reaches the node's disk;
* **measured** at every GC pass (``diskuse.py``): ``gpushare_mps_shm_bytes``, and
  ``mps_shm_over_limit`` logged once when it passes ``--cache-dir-limit-mib``;
* **swept**: a segment nobody holds is removed. The daemon does not see the clients'
  processes (no ``hostPID``), only its own and the MPS daemons it runs, so it removes
  only while no MPS client lives on the node (no container holds units or a prepared
  claim on an ``mps`` card, no namespace is capped): then no client holds anything,
  and a segment that none of the processes it sees maps or keeps open (the servers',
  read in ``/proc/<pid>/maps`` and ``/proc/<pid>/fd``) and that has not changed for the
  grace period is unlinked (never followed: a link, FIFO or socket is unlinked as
  itself). A segment a live client holds is never removed; on a node whose clients
  never all end, leftovers stay until they do, bounded and measured meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gpushare.host.diskuse import Usage, measure
from gpushare.share.records import Snapshot

log = structlog.get_logger(__name__)

#: A segment younger than this is left (a client may be about to map it).
DEFAULT_GRACE_SECONDS = 60.0
#: At most this many entries are looked at (and removed) per pass.
MAX_ENTRIES = 4096


@dataclass
class ShmState:
    """What the last pass found (read by the metrics)."""

    usage: Usage = field(default_factory=lambda: Usage(0, 0, True))
    removed_total: int = 0
    over_limit: bool = False
    unsure: bool = False  # a process's maps could not be read at the last sweep (logged once)


def clients_live(
    snapshot: Snapshot,
    mps_cards: Collection[str],
    namespaces: int,
    claims: Mapping[str, Sequence[object]] | None,
) -> bool:
    """Whether some container may be an MPS client now: one holds units of an ``mps``
    card (the kubelet's fresh records), a namespace is capped (every client's, where the
    control daemon has namespaces), or the DRA driver holds a claim on an ``mps`` card."""
    counts = snapshot.used_counts
    if any(by_card.get(uuid) for by_card in counts.values() for uuid in mps_cards):
        return True
    if namespaces:
        return True
    return claims is not None and any(claims.get(uuid) for uuid in mps_cards)


def held_inodes(device: int, proc_root: Path = Path("/proc")) -> set[int] | None:
    """Inodes of file system ``device`` that a process this daemon sees maps or keeps
    open; None when some process could not be read (then nothing can be called free)."""
    held: set[int] = set()
    major, minor = os.major(device), os.minor(device)
    wanted = f"{major:02x}:{minor:02x}"
    try:
        pids = [p for p in os.listdir(proc_root) if p.isascii() and p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            held.update(_mapped(proc_root / pid / "maps", wanted))
            held.update(_open(proc_root / pid / "fd", device))
        except FileNotFoundError:
            continue  # the process ended meanwhile
        except OSError:
            return None
    return held


def _mapped(maps: Path, wanted: str) -> Iterator[int]:
    with maps.open("rb") as lines:
        for line in lines:
            fields = line.split(None, 5)
            if len(fields) >= 5 and fields[3].decode("ascii", "replace") == wanted:
                with contextlib.suppress(ValueError):
                    yield int(fields[4])


def _open(fd_dir: Path, device: int) -> Iterator[int]:
    for name in os.listdir(fd_dir):
        try:
            info = os.stat(fd_dir / name)
        except OSError:
            continue  # closed meanwhile, or not a file
        if info.st_dev == device:
            yield info.st_ino


class MpsShm:
    """Measures and sweeps the MPS ``/dev/shm`` directory at every GC pass."""

    def __init__(
        self,
        path: Path,
        *,
        limit_bytes: int,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.path = path
        self.limit_bytes = limit_bytes
        self.grace_seconds = grace_seconds
        self.proc_root = proc_root
        self.state = ShmState()

    def pass_(self, *, clients_live: bool, now: float) -> list[str]:
        """One pass: sweep (only when ``clients_live`` is False), then measure. The names
        removed."""
        removed = [] if clients_live else self._sweep(now)
        if removed:
            self.state.removed_total += len(removed)
            log.info("mps_shm_swept", path=str(self.path), removed=removed[:20], count=len(removed))
        self._measure()
        return removed

    def _sweep(self, now: float) -> list[str]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return []
        try:
            device = os.fstat(fd).st_dev
            held = held_inodes(device, self.proc_root)
            if held is None and not self.state.unsure:
                log.warning(
                    "mps_shm_not_swept",
                    path=str(self.path),
                    reason="a process's maps could not be read: nothing can be called free",
                )
            self.state.unsure = held is None
            return [] if held is None else self._remove_free(fd, held, now)
        finally:
            os.close(fd)

    def _remove_free(self, fd: int, held: set[int], now: float) -> list[str]:
        removed = []
        for count, name in enumerate(sorted(os.listdir(fd))):
            if count >= MAX_ENTRIES:
                break
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode) or info.st_ino in held:
                continue
            if now - info.st_mtime < self.grace_seconds:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
                removed.append(name)
        return removed

    def _measure(self) -> None:
        parent, name = self.path.parent, self.path.name
        try:
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            usage = measure(fd, name)
        finally:
            os.close(fd)
        self.state.usage = usage
        over = usage.bytes > self.limit_bytes
        if over and not self.state.over_limit:
            log.warning(
                "mps_shm_over_limit",
                path=str(self.path),
                bytes=usage.bytes,
                limit_bytes=self.limit_bytes,
                entries=usage.entries,
                measured_completely=usage.complete,
            )
        self.state.over_limit = over


class MpsShmMetrics:
    """The MPS ``/dev/shm`` figures as Prometheus gauges (register it in a registry)."""

    def __init__(self, shm: MpsShm) -> None:
        self._shm = shm

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = self._shm.state
        yield GaugeMetricFamily(
            "gpushare_mps_shm_bytes",
            "Bytes in the /dev/shm directory MPS servers and clients share, at the last GC "
            "pass (a lower bound for a tree too large to measure)",
            value=state.usage.bytes,
        )
        yield GaugeMetricFamily(
            "gpushare_mps_shm_over_limit",
            "1 when the MPS /dev/shm directory is larger than --cache-dir-limit-mib",
            value=int(state.over_limit),
        )
        yield CounterMetricFamily(
            "gpushare_mps_shm_segments_removed",
            "Entries of the MPS /dev/shm directory removed because nothing held them",
            value=state.removed_total,
        )
