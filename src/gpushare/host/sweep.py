"""Applying a host cleanup's plan (``host/sweepplan.py``) on the node.

Run by the one-shot cleanup pod of ``kubectl gpushare uninstall`` (``node/hostsweep.py``),
never by the daemon: it unmounts the tmpfs mounts of ``host/cachefs.py`` (``CAP_SYS_ADMIN``
in the host's mount namespace, reached through a Bidirectional hostPath), then removes
what the plan names. Directories (what tenants wrote: cache directories, the MPS shm) are
buried and deleted by the bounded reaper, never through a link (``host/optout.py``,
``host/tombstones.py``); sockets and spec files are unlinked by name (a link is removed,
not followed). Only a tmpfs of ours (its source ``gpushare-cache`` or
``gpushare-mps-shm``) is ever unmounted. Every step's outcome is in the returned
:class:`Outcome`, which the cleanup reports.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gpushare.host.cachefs import SHM_SOURCE, SOURCE
from gpushare.host.leftovers import CACHE_MOUNT, SHM_MOUNT, Held, Plan, Seen
from gpushare.host.optout import apply_plan, seen_in
from gpushare.host.sweepplan import (
    DEVICE_PLUGINS,
    DRA_PLUGIN,
    REGISTRY,
    Naming,
    Places,
    Sweep,
    sweep,
)

log = structlog.get_logger(__name__)

MNT_DETACH = 2
#: mount point (relative to the host directory) -> the source our tmpfs there has
OUR_MOUNTS = {CACHE_MOUNT: SOURCE, SHM_MOUNT: SHM_SOURCE}
#: The most mounts of ours stacked on one path that are taken off (a mount made twice).
MAX_STACKED = 8


@dataclass(frozen=True)
class Dirs:
    """Where the daemon wrote, as the cleanup sees the node (the DaemonSet's paths)."""

    host_dir: Path
    device_plugins: Path
    kubelet_root: Path
    driver: str
    cdi: Sequence[Path] = ()
    #: the host directory's parent, where the host directory is not a mount point (the
    #: cleanup pod mounts it apart: its own mount of the host directory cannot be removed)
    host_parent: Path | None = None

    def views(self) -> list[Path]:
        """The host directory, and where the mount of its parent shows it too."""
        if self.host_parent is None:
            return [self.host_dir]
        return [self.host_dir, self.host_parent / self.host_dir.name]

    def places(self) -> dict[str, Path]:
        found = {
            DEVICE_PLUGINS: self.device_plugins,
            REGISTRY: self.kubelet_root / "plugins_registry",
            DRA_PLUGIN: self.kubelet_root / "plugins" / self.driver,
        }
        found.update({str(d): d for d in self.cdi})
        return found


@dataclass
class Outcome:
    """What the cleanup did: names removed, unmounted, kept (with why), failed (with why)."""

    removed: list[str] = field(default_factory=list)
    unmounted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    host_dir_removed: bool = False
    #: facts that leave nothing of ours behind (the host directory is a mount point)
    notes: dict[str, str] = field(default_factory=dict)


def _mountinfo(proc_self: Path = Path("/proc/self")) -> list[tuple[str, str, str]]:
    """(mount point, type, source) of every mount, in mountinfo's order (later on top)."""
    try:
        lines = (proc_self / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields = head.split(" ")
        rest = tail.split(" ")
        if not sep or len(fields) < 5 or len(rest) < 2:
            continue
        point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        found.append((point, rest[0], rest[1]))
    return found


def our_mounts(host_dir: Path) -> frozenset[str]:
    """Of :data:`OUR_MOUNTS`, those whose topmost mount is our tmpfs."""
    top: dict[str, tuple[str, str]] = {}
    for point, fs_type, source in _mountinfo():
        top[point] = (fs_type, source)
    return frozenset(
        name
        for name, source in OUR_MOUNTS.items()
        if top.get(str(host_dir / name)) == ("tmpfs", source)
    )


def _unmount(path: Path) -> str:
    """Unmount our tmpfs from ``path``; "" when done, else why not. A busy mount (a
    process with a file open in it; the plan says no listed container holds any) is
    detached lazily: it leaves the mount table now, its memory when its last user goes."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.umount2(str(path).encode(), 0) == 0:
        return ""
    code = ctypes.get_errno()
    if code == errno.EBUSY and libc.umount2(str(path).encode(), MNT_DETACH) == 0:
        log.warning("host_cleanup_detached_busy_mount", path=str(path))
        return ""
    return os.strerror(code)


def _unmount_ours(dirs: Dirs, which: Sequence[str], outcome: Outcome) -> None:
    """Unmount our tmpfs mounts ``which`` from the host directory, and the copies the
    mount of its parent carries (a hostPath is bound recursively: the copies there are
    this pod's own, and would keep the directories busy)."""
    for base in dirs.views():
        for name in which:
            for _ in range(MAX_STACKED):
                if name not in our_mounts(base):
                    break
                why = _unmount(base / name)
                if why:
                    outcome.failed[str(base / name)] = f"not unmounted: {why}"
                    break
                if base == dirs.host_dir:
                    outcome.unmounted.append(name)


def names_in(path: Path) -> frozenset[str] | None:
    """The names in directory ``path`` (not followed if a link); None when absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return frozenset(os.listdir(fd))
    finally:
        os.close(fd)


def places_at(dirs: Dirs) -> Places:
    found = {}
    for key, path in dirs.places().items():
        names = names_in(path)
        if names is not None:
            found[key] = names
    return Places(found, frozenset(str(d) for d in dirs.cdi if str(d) in found))


def seen_at(host_dir: Path) -> Seen:
    """The host directory, with our tmpfs mounts found mounted."""
    seen = seen_in(host_dir)
    return Seen(seen.top, seen.containers, seen.retired, our_mounts(host_dir))


def decide(dirs: Dirs, naming: Naming, held: Held) -> Sweep:
    return sweep(seen_at(dirs.host_dir), places_at(dirs), naming, held)


def _remove_outside(dirs: Dirs, decided: Sweep, outcome: Outcome) -> None:
    places = dirs.places()
    for place, name in decided.remove:
        path = places[place] / name
        try:
            if path.is_dir() and not path.is_symlink():
                raise IsADirectoryError(errno.EISDIR, "a directory where a file was expected")
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            outcome.failed[str(path)] = exc.strerror or str(exc)
            continue
        outcome.removed.append(str(path))
    for place in decided.rmdir:
        try:
            places[place].rmdir()
            outcome.removed.append(str(places[place]))
        except FileNotFoundError:
            pass
        except OSError as exc:
            outcome.failed[str(places[place])] = exc.strerror or str(exc)


def _host_dir(dirs: Dirs, decided: Plan, outcome: Outcome) -> None:
    removed, failed = apply_plan(dirs.host_dir, decided, trees=True)
    outcome.removed.extend(f"{dirs.host_dir}/{name}" for name in removed)
    outcome.failed.update({f"{dirs.host_dir}/{n}": why for n, why in failed.items()})
    outcome.kept.update({f"{dirs.host_dir}/{n}": why for n, why in decided.keep.items()})
    target = dirs.host_dir if dirs.host_parent is None else dirs.host_parent / dirs.host_dir.name
    if decided.drop_host_dir and not failed and names_in(target) is not None:
        try:
            target.rmdir()
            outcome.host_dir_removed = True
        except OSError as exc:
            if exc.errno == errno.EBUSY:  # a mount point (an operator's volume): stays, empty
                outcome.notes[str(dirs.host_dir)] = "empty, left: a mount point"
            else:  # something appeared meanwhile
                outcome.kept[str(dirs.host_dir)] = f"not removed: {exc.strerror or exc}"


def clean(dirs: Dirs, naming: Naming, held: Held) -> Outcome:
    """Unmount and remove everything of gpushare on the node that ``held`` does not name."""
    outcome = Outcome()
    decided = decide(dirs, naming, held)
    if decided.host.unmount:
        _unmount_ours(dirs, decided.host.unmount, outcome)
        decided = decide(dirs, naming, held)  # what was under the mounts, if anything
    _remove_outside(dirs, decided, outcome)
    outcome.kept.update(decided.keep)
    _host_dir(dirs, decided.host, outcome)
    for name in decided.host.unmount:  # still mounted: a failure said above
        outcome.kept.setdefault(f"{dirs.host_dir}/{name}", "a tmpfs still mounted")
    return outcome


def summary(outcome: Outcome, limit: int) -> Mapping[str, object]:
    """The outcome as a JSON-able report of at most about ``limit`` characters: counts,
    and as many kept and failed names (with why) as fit."""
    report: dict[str, object] = {
        "removed": len(outcome.removed),
        "unmounted": outcome.unmounted,
        "host_dir_removed": outcome.host_dir_removed,
        "notes": outcome.notes,
        "kept": {},
        "failed": {},
    }
    budget = limit - 200
    for key in ("failed", "kept"):
        items: dict[str, str] = getattr(outcome, key)
        shown: dict[str, str] = {}
        for name, why in sorted(items.items()):
            cost = len(name) + len(why) + 8
            if cost > budget:
                report[f"{key}_not_shown"] = len(items) - len(shown)
                break
            budget -= cost
            shown[name] = why
        report[key] = shown
    return report


__all__ = ["Dirs", "Outcome", "clean", "decide", "names_in", "our_mounts", "summary"]
