"""Applying :func:`gpushare.host.leftovers.plan` when the node is opted out.

The daemon calls :func:`remove_leftovers` at its last stop on a node that no longer
carries the opt-in label (``kubectl gpushare uninstall``), after its device-plugin
servers are gone (no Allocate can come) and with a PodResources read taken then. What
it removes and what it keeps, with why, is logged (``uninstall_removed``,
``uninstall_kept``). The cache file system mounted on ``containers/`` stays mounted
(unmounting needs ``CAP_SYS_ADMIN``, which the daemon does not hold): it is emptied.
"""

from __future__ import annotations

import contextlib
import errno
import json
from pathlib import Path

import structlog

from gpushare.host.gc import holder_keys, live_keys
from gpushare.host.leftovers import RETIRED_FILE, TREES, Held, Plan, Seen, plan
from gpushare.host.library import CACHE_ROOT_NAME
from gpushare.host.tombstones import Reaper, bury, is_tombstone
from gpushare.share.records import Snapshot

log = structlog.get_logger(__name__)


def _names(path: Path) -> frozenset[str]:
    try:
        return frozenset(p.name for p in path.iterdir())
    except OSError:
        return frozenset()


def _retired(host_dir: Path) -> dict[str, frozenset[str]]:
    """``libraries.json``'s versions and their holders; a version whose entry cannot be
    read is absent (then kept while any container holds memory units)."""
    try:
        data = json.loads((host_dir / RETIRED_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(version): frozenset(str(h) for h in entry["holders"])
        for version, entry in data.items()
        if isinstance(entry, dict) and isinstance(entry.get("holders"), list)
    }


def seen_in(host_dir: Path) -> Seen:
    """What :func:`plan` needs to know about ``host_dir``."""
    top = _names(host_dir)
    containers = _names(host_dir / CACHE_ROOT_NAME) if CACHE_ROOT_NAME in top else frozenset()
    return Seen(top, containers, _retired(host_dir))


def held_by(snapshot: Snapshot) -> Held:
    """What the containers of one PodResources read hold. DRA claims count as prepared
    (the daemon cannot tell after its driver stopped): their directories are kept."""
    return Held(frozenset(live_keys(snapshot)), frozenset(holder_keys(snapshot)), claims=True)


def _remove(host_dir: Path, name: str, trees: bool) -> Path | None:
    """Remove one name of the plan; the directory it was buried in for the reaper, if so.

    A directory (what tenants wrote into: a cache directory, the lock directory, a
    tombstone; with ``trees``, also the daemon's own ``mps/``, ``claimholders/`` and
    ``dra/`` at the top) is buried where it is and deleted by :class:`Reaper`
    afterwards, as garbage collection deletes them (docs/security.md: bounded steps,
    through no link); anything else is unlinked (a link is removed, never followed)."""
    path = host_dir / name
    if path.is_dir() and not path.is_symlink():
        parent = path.parent
        top_tree = parent == host_dir and (name in TREES or is_tombstone(name))
        if parent != host_dir / CACHE_ROOT_NAME and not (trees and top_tree):
            # not one the daemon writes: never removed as a tree
            raise IsADirectoryError(errno.EISDIR, "a directory where a file was expected")
        if not is_tombstone(path.name):
            bury(parent, path.name)
        return parent
    path.unlink()
    return None


def apply_plan(host_dir: Path, decided: Plan, *, trees: bool) -> tuple[list[str], dict[str, str]]:
    """Remove the names of ``decided`` from ``host_dir`` (the daemon's own trees at the
    top only with ``trees``: the host cleanup, which unmounts first); the names removed
    and those that could not be, with why. ``containers/`` goes when the plan says so."""
    removed: list[str] = []
    failed: dict[str, str] = {}
    graves: set[Path] = set()
    for name in decided.remove:
        if not trees and name in TREES:
            continue  # left to the host cleanup (a tmpfs may be mounted in it)
        try:
            grave = _remove(host_dir, name, trees)
            removed.append(name)
        except FileNotFoundError:
            removed.append(name)
            continue
        except OSError as exc:
            failed[name] = exc.strerror or str(exc)
            continue
        if grave is not None:
            graves.add(grave)
    for grave in sorted(graves):
        reaper = Reaper(grave)
        reaper.drain()
        where = "" if grave == host_dir else f"{grave.relative_to(host_dir)}/"
        failed.update({f"{where}{n}": why for n, why in reaper.stuck.items()})
    if decided.drop_cache_root and not failed:
        with contextlib.suppress(OSError):  # a mount point: stays, emptied
            (host_dir / CACHE_ROOT_NAME).rmdir()
    return removed, failed


def remove_leftovers(host_dir: Path, snapshot: Snapshot) -> Plan:
    """Remove from ``host_dir`` what no container of ``snapshot`` can use; log what was
    removed, what could not be, and what is kept and why. The trees of MPS and DRA
    and the tmpfs mounts are left to the host cleanup (``node/hostsweep.py``)."""
    decided = plan(seen_in(host_dir), held_by(snapshot))
    removed, failed = apply_plan(host_dir, decided, trees=False)
    log.info("uninstall_removed", host_dir=str(host_dir), names=removed)
    for name, why in failed.items():
        log.warning("uninstall_remove_failed", name=name, error=why)
    for name, why in decided.keep.items():
        log.info("uninstall_kept", name=name, why=why)
    return decided


__all__ = ["apply_plan", "held_by", "remove_leftovers", "seen_in"]
