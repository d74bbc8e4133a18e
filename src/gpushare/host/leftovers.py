"""What an uninstall may remove from the host directory, given what containers still hold.

When its node is opted out (``kubectl gpushare uninstall``), the daemon goes for good,
but containers it admitted may run on for days: their mounts point into
``--host-lib-dir`` (the versioned interposer, its preload file, their cache directory,
HAMi-core's lock directory) and a later install must not misread their memory units
(``memory-unit.json``, ``host/unitguard.py``). So a name is removed only when no
container listed by the kubelet's PodResources can use it, and everything kept is said,
with why, so that an operator knows what to remove after those containers end.

This module decides, on names and plain sets (no file system): :func:`plan` over a
:class:`Seen` (what is in the directory, what the library records say) and a
:class:`Held` (what the running containers hold, from one successful PodResources
read). Applying the plan (unmounting the cache file system, removing, logging) is the
caller's. The rules, one per kind of name:

* ``containers/c-<hex>`` and ``containers/c-<hex>.json``: removed unless ``c-<hex>`` is
  the cache key of a container listed (``host/gc.py`` ``live_keys``).
* ``containers/d-<key>``: a DRA claim's cache directory: kept while any claim is
  prepared (the DRA driver removes its own when the kubelet unprepares the claim).
* ``libvgpu.so.<hash>`` and ``ld.so.preload.<hash>``: a version retired in
  ``libraries.json`` is kept while one of the containers alive at its retirement is
  still listed; any other version (the current one, or one never retired) is kept while
  any container holds memory units (it may be mounted by any of them).
* ``containers/.tomb-*``: removed (buried already, not deleted yet).
* ``memory-unit.json``, ``containers/vgpulock`` and the memory hook
  (``gpushare-memory-hook.<hash>``, which the runtime runs): kept while any
  container holds memory units (they read or run them; a reinstall checks the units
  against the first).
* ``libraries.json``: kept while a versioned file is kept.
* ``mps/`` (the MPS control daemon's pipe and log directories and the clients'
  ``/dev/shm``, ``host/mps.py``): kept while any container holds memory units (an MPS
  client among them may map its shm segments); else removed as a tree, its tmpfs on
  ``mps/shm`` unmounted first.
* ``claimholders/`` and ``dra/`` (the DRA driver's holder records and checkpoint): kept
  while DRA claims are prepared on the node (:attr:`Held.claims`).
* ``.tomb-*`` (a tree buried and not deleted yet): removed.
* The cache file system (a tmpfs on ``containers/``) is unmounted and ``containers/``
  removed only when nothing under it is kept; the host directory itself only when
  everything in it is removed (:attr:`Plan.drop_host_dir`).
* Names this module does not know (an operator's own) are never touched.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpushare.host.library import CACHE_ROOT_NAME, HOOK_NAME, LIBRARY_NAME, LOCK_DIR_NAME
from gpushare.host.tombstones import TOMB_PREFIX
from gpushare.host.unitguard import STATE_FILE

RETIRED_FILE = "libraries.json"
#: Directories of the daemon's own at the top of the host directory (removed as trees).
MPS_DIR = "mps"
HOLDERS_DIR = "claimholders"
DRA_DIR = "dra"
TREES = frozenset({MPS_DIR, HOLDERS_DIR, DRA_DIR})
#: The tmpfs mounts of ``host/cachefs.py``, relative to the host directory.
CACHE_MOUNT = CACHE_ROOT_NAME
SHM_MOUNT = f"{MPS_DIR}/shm"
_CACHE = re.compile(r"^(c-[0-9a-f]{20})(\.json)?$")
_CLAIM = re.compile(r"^d-[0-9a-f]{20}(\.json)?$")
_VERSIONED = re.compile(r"^(?:" + re.escape(LIBRARY_NAME) + r"|ld\.so\.preload)\.([0-9a-f]{12})$")
#: Names in the host directory that the daemon writes beside the versioned files.
_SHARED = frozenset({STATE_FILE, LOCK_DIR_NAME})
_HOOK = re.compile(r"^" + re.escape(HOOK_NAME) + r"\.[0-9a-f]{12}$")


@dataclass(frozen=True)
class Seen:
    """The host directory: its top-level names, those in ``containers/``, and the
    containers (holder keys, ``host/gc.py`` ``holder_keys``) alive when each retired
    library version was retired (``libraries.json``; a version absent was never
    retired)."""

    top: frozenset[str]
    containers: frozenset[str] = frozenset()
    retired: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: our tmpfs mounts found mounted (:data:`CACHE_MOUNT`, :data:`SHM_MOUNT`)
    mounted: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Held:
    """What the containers the kubelet lists hold: their cache keys (``c-<hex>``, the
    directories' names, ``host/library.py`` ``cache_key``),
    their holder keys, their per-grant CDI spec names (``host/gc.py`` ``live_grants``),
    whether any DRA claim is prepared on the node, and the UIDs of the claims known to
    be in use (None: not known, every claim spec is kept then)."""

    cache_keys: frozenset[str] = frozenset()
    holders: frozenset[str] = frozenset()
    claims: bool = False
    grants: frozenset[str] = frozenset()
    claim_uids: frozenset[str] | None = None

    @property
    def memory(self) -> bool:
        return bool(self.cache_keys) or bool(self.holders)


@dataclass(frozen=True)
class Plan:
    """Names to remove (relative to the host directory, ``containers/...`` for those
    in it), names kept with why, whether the cache file system goes too, the tmpfs
    mounts to unmount before removing (nothing under them is kept), and whether the
    host directory itself goes (once everything in it is removed)."""

    remove: tuple[str, ...]
    keep: Mapping[str, str]
    drop_cache_root: bool
    unmount: tuple[str, ...] = ()
    drop_host_dir: bool = False


def _library_kept(digest: str, seen: Seen, held: Held) -> str | None:
    if digest in seen.retired:
        users = seen.retired[digest] & held.holders
        return f"mounted by {len(users)} running container(s)" if users else None
    return "may be mounted by a running container" if held.memory else None


def _top_kept(name: str, seen: Seen, held: Held, kept_versions: bool) -> str | None:
    if (match := _VERSIONED.match(name)) is not None:
        return _library_kept(match.group(1), seen, held)
    if name in _SHARED or _HOOK.match(name):
        return "used by running containers with memory units" if held.memory else None
    if name == RETIRED_FILE:
        return "records the library versions kept" if kept_versions else None
    if name == MPS_DIR:
        return "MPS clients may run (containers hold memory units)" if held.memory else None
    if name in (HOLDERS_DIR, DRA_DIR):
        return "DRA claims are prepared on the node" if held.claims else None
    if name.startswith(TOMB_PREFIX):
        return None  # buried already: what the reaper had not deleted yet
    return ""  # not ours: never removed, not reported


def _cache_kept(name: str, held: Held) -> str | None:
    if (match := _CACHE.match(name)) is not None:
        return "its container is running" if match.group(1) in held.cache_keys else None
    if _CLAIM.match(name) is not None:
        return "DRA claims are prepared on the node" if held.claims else None
    if name == LOCK_DIR_NAME:
        return "used by running containers with memory units" if held.memory else None
    if name.startswith(TOMB_PREFIX):
        return None  # buried already: what the reaper had not deleted yet
    return ""


def plan(seen: Seen, held: Held) -> Plan:
    """What uninstall removes from the host directory and what it must leave."""
    remove: list[str] = []
    keep: dict[str, str] = {}
    foreign = False
    for name in sorted(seen.containers):
        why = _cache_kept(name, held)
        path = f"{CACHE_ROOT_NAME}/{name}"
        if why is None:
            remove.append(path)
        elif why:
            keep[path] = why
        else:
            foreign = True
    cache_kept = bool(keep)
    drop_cache_root = not cache_kept and not foreign and CACHE_ROOT_NAME in seen.top
    kept_versions = False
    for name in sorted(seen.top - {CACHE_ROOT_NAME, RETIRED_FILE}):
        why = _top_kept(name, seen, held, kept_versions)
        if why is None:
            remove.append(name)
        elif why:
            keep[name] = why
            kept_versions = kept_versions or _VERSIONED.match(name) is not None
    if RETIRED_FILE in seen.top:
        if (why := _top_kept(RETIRED_FILE, seen, held, kept_versions)) is None:
            remove.append(RETIRED_FILE)
        else:
            keep[RETIRED_FILE] = why
    if CACHE_ROOT_NAME in seen.top and not drop_cache_root:
        why = "holds what running containers use" if cache_kept else "holds names not ours"
        keep[CACHE_ROOT_NAME] = why
    unmount = [CACHE_MOUNT] if drop_cache_root and CACHE_MOUNT in seen.mounted else []
    if MPS_DIR in remove and SHM_MOUNT in seen.mounted:
        unmount.append(SHM_MOUNT)
    gone = set(remove) | ({CACHE_ROOT_NAME} if drop_cache_root else set())
    drop_host_dir = seen.top <= gone
    return Plan(tuple(remove), keep, drop_cache_root, tuple(unmount), drop_host_dir)


__all__ = [
    "CACHE_MOUNT",
    "DRA_DIR",
    "HOLDERS_DIR",
    "MPS_DIR",
    "RETIRED_FILE",
    "SHM_MOUNT",
    "TREES",
    "Held",
    "Plan",
    "Seen",
    "plan",
]
