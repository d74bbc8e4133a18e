"""The interposer on the host: a versioned copy of libvgpu.so and per-container caches.

The library is installed as ``libvgpu.so.<sha256 prefix>`` and never overwritten:
containers keep the file they started with mounted, and a new version gets a new
name (replacing a file under running containers crashed them in HAMi). Each memory
allocation gets a fresh cache directory, named after the units it holds, with a
small record beside it so that garbage collection knows whose it was. Cache
directories, records and HAMi-core's lock directory live in ``containers/``, a
directory only root can enter (docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import BinaryIO

import structlog

from gpushare.host.tombstones import bury, wake
from gpushare.share.answers import CONTAINER_LIBRARY

log = structlog.get_logger(__name__)

LIBRARY_NAME = "libvgpu.so"
HOOK_NAME = "gpushare-memory-hook"
CACHE_ROOT_NAME = "containers"
LOCK_DIR_NAME = "vgpulock"
PRIVATE_MODE = 0o700
LOCK_DIR_MODE = 0o1777
HASH_PREFIX = 12


class LibraryError(Exception):
    """The interposer library cannot be used; the message is one readable line."""


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()[:HASH_PREFIX]


def _atomic_write(target: Path, write: Callable[[BinaryIO], object]) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def install_library(source: Path, host_dir: Path) -> Path:
    """Copy ``source`` to ``host_dir/libvgpu.so.<hash>`` unless that file is already there."""
    return _install_versioned(
        source,
        host_dir,
        LIBRARY_NAME,
        f"cannot read the interposer library {source}",
        "set --library, or run with --no-enforcement",
        "the interposer",
    )


def install_hook(source: Path, host_dir: Path) -> Path:
    """Copy the driver memory hook ``source`` to ``host_dir/gpushare-memory-hook.<hash>``
    (0755, never overwritten: a CDI spec names the version it was written with) unless
    that file is already there. The runtime runs it on the host (docs/security.md)."""
    return _install_versioned(
        source,
        host_dir,
        HOOK_NAME,
        f"cannot read the driver memory hook {source}",
        "set --memory-hook, or pin memoryEnforcement to interposer",
        "the driver memory hook",
    )


def _install_versioned(
    source: Path, host_dir: Path, name: str, unreadable: str, hint: str, what: str
) -> Path:
    try:
        digest = _digest(source)
    except OSError as exc:
        raise LibraryError(f"{unreadable}: {exc.strerror}; {hint}") from None
    target = host_dir / f"{name}.{digest}"
    try:
        host_dir.mkdir(parents=True, exist_ok=True)
        if not target.exists() or _digest(target) != digest:
            with source.open("rb") as src:
                _atomic_write(target, lambda out: shutil.copyfileobj(src, out))
    except OSError as exc:
        raise LibraryError(f"cannot install {what} into {host_dir}: {exc}") from None
    return target


def install_preload_file(library: Path) -> Path:
    """A host file for /etc/ld.so.preload that names the library's container path."""
    target = library.with_name(f"ld.so.preload.{library.name.rsplit('.', 1)[-1]}")
    content = f"{CONTAINER_LIBRARY}\n".encode()
    if not target.exists() or target.read_bytes() != content:
        _atomic_write(target, lambda out: out.write(content))
        os.chmod(target, 0o644)
    return target


def cache_root(host_dir: Path) -> Path:
    """``<host_dir>/containers``: the daemon's private directory (0700 root) holding the
    cache directories, their records, the lock directory and the tombstones."""
    return host_dir / CACHE_ROOT_NAME


def ensure_cache_root(host_dir: Path) -> Path:
    """Create or tighten the private root (0700): no other user of the host may reach
    what tenants write below it (a setuid file planted there would be a door to root)."""
    root = cache_root(host_dir)
    try:
        os.mkdir(root, PRIVATE_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:
        host_dir.mkdir(parents=True, exist_ok=True)
        os.mkdir(root, PRIVATE_MODE)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise LibraryError(
            f"{root} must be a directory owned by uid {os.geteuid()} (the daemon's user); "
            "remove it and restart"
        )
    if stat.S_IMODE(info.st_mode) != PRIVATE_MODE:
        os.chmod(root, PRIVATE_MODE)
    return root


def _lock_dir_problem(path: Path) -> str | None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory (a link or a file)"
    if stat.S_IMODE(info.st_mode) != LOCK_DIR_MODE:
        return f"mode {stat.S_IMODE(info.st_mode):04o}"
    if info.st_uid != os.geteuid():
        if (info.st_dev, info.st_ino) in _FOREIGN_OWNER_SEEN:
            return None  # already tried and reported: the mode is right, nothing to do
        return f"owned by uid {info.st_uid}"
    return None


def _repair_in_place(path: Path) -> str:
    """Give the directory at ``path`` mode 1777 (and the daemon's ownership, when the
    daemon may chown) through a descriptor opened without following a link: the same
    inode stays, so every running container keeps a working lock directory. Returns
    what is left wrong ("" for nothing). Raises OSError when ``path`` is no directory."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY)
    try:
        info = os.fstat(fd)
        through = f"/proc/self/fd/{fd}"  # the inode behind fd, never a link's target
        if stat.S_IMODE(info.st_mode) != LOCK_DIR_MODE:
            os.chmod(through, LOCK_DIR_MODE)  # CAP_FOWNER for another uid's directory:
            # without it, PermissionError: the caller replaces the directory instead
        if info.st_uid != os.geteuid() or info.st_gid != os.getegid():
            try:
                os.chown(through, os.geteuid(), os.getegid())
            except PermissionError:  # no CAP_CHOWN (the DaemonSet drops it): harmless,
                # the directory sits in the 0700 root; its mode is what containers need
                return f"owned by uid {info.st_uid}"
        return ""
    finally:
        os.close(fd)


#: Lock directories whose foreign owner was reported already (by inode), logged once.
_FOREIGN_OWNER_SEEN: set[tuple[int, int]] = set()


def ensure_lock_dir(host_dir: Path) -> Path:
    """The host directory mounted at ``/tmp/vgpulock`` in every container, checked and
    repaired; never raises (a tenant must not be able to stop the daemon from starting).

    Containers share it read-write, so a tenant can chown, chmod or fill it. A directory
    with the wrong mode or owner is repaired IN PLACE, through a descriptor (issue 23
    item 5): it is what every running container has mounted, so it is never buried nor
    replaced (a replaced one left each running container an unlinked directory in
    which HAMi-core could create no lock file). Without CAP_CHOWN a foreign owner stays
    (logged once); the mode is restored. Only something that is not a directory (a
    link or a file: no container mounts those) is buried and replaced."""
    root = cache_root(host_dir)
    path = root / LOCK_DIR_NAME
    problem = _lock_dir_problem(path)
    if problem is None:
        return path
    if problem != "missing" and not problem.startswith("not a directory"):
        try:
            left = _repair_in_place(path)
        except PermissionError:
            # Another uid's directory and no CAP_FOWNER (the DaemonSet keeps it): the
            # best left is the old way, a fresh directory for new containers.
            left = None
        except OSError as exc:  # swapped for a link or file meanwhile: the next pass
            log.error("lock_dir_unusable", path=str(path), problem=problem, error=str(exc))
            return path
        if left is not None:
            if left:
                info = os.lstat(path)
                _FOREIGN_OWNER_SEEN.add((info.st_dev, info.st_ino))
            log.warning("lock_dir_repaired", path=str(path), problem=problem, left=left or None)
            return path
        problem += " (cannot repair in place without CAP_FOWNER)"
    try:
        ensure_cache_root(host_dir)
        if problem != "missing":
            bury(root, LOCK_DIR_NAME)
        os.mkdir(path, LOCK_DIR_MODE)
        os.chmod(path, LOCK_DIR_MODE)  # past the umask; ours, in our private root
    except (OSError, LibraryError) as exc:
        log.error("lock_dir_unusable", path=str(path), problem=problem, error=str(exc))
        return path
    if problem != "missing":
        log.warning("lock_dir_replaced", path=str(path), problem=problem)
        wake(root)
    return path


def cache_key(device_ids: Iterable[str]) -> str:
    """A directory name derived from the memory units a container holds."""
    joined = "\n".join(sorted(device_ids)).encode()
    return "c-" + hashlib.sha256(joined).hexdigest()[:20]


#: Held while a cache directory is created or buried, so that garbage collection never
#: buries one that an Allocate is preparing at the same moment. Only renames, a mkdir
#: and a small record write happen under it: never work a tenant can make long.
CACHE_LOCK = threading.Lock()


def prepare_cache_dir(host_dir: Path, device_ids: list[str]) -> Path:
    """A fresh, empty, world-writable cache directory for the container holding these units.

    A directory already there belonged to an earlier holder of the same units (the
    kubelet reuses units only after their container is gone). What that tenant wrote
    is never reused nor emptied here: the directory is buried (one rename) and a new
    one made, so this costs the same whatever the tree it left behind.
    """
    return _fresh_cache_dir(host_dir, cache_key(device_ids), {"device_ids": sorted(device_ids)})


#: Cache directories of DRA claims: another prefix than the device plugin's, so that its
#: garbage collection (which knows only PodResources' units) never takes them; the DRA
#: driver releases them itself at unprepare, from its checkpoint.
CLAIM_KEY_PREFIX = "d-"


def claim_cache_key(claim_uid: str, request: str, device: str) -> str:
    """The directory name of one claim's share of one device."""
    joined = "\n".join((claim_uid, request, device)).encode()
    return CLAIM_KEY_PREFIX + hashlib.sha256(joined).hexdigest()[:20]


def prepare_claim_cache_dir(host_dir: Path, key: str) -> Path:
    """A fresh cache directory for a DRA claim (same rules as :func:`prepare_cache_dir`:
    in the private root, a leftover buried, never reused). No record beside it: the DRA
    driver's checkpoint names the claim of each key."""
    if not key.startswith(CLAIM_KEY_PREFIX) or "/" in key:
        raise ValueError(f"{key!r} is not a claim cache key")
    return _fresh_cache_dir(host_dir, key, None)


def repair_cache_dir(host_dir: Path, key: str) -> bool:
    """Give the cache directory ``key`` that something else made the mode the daemon
    gives its own (0777: a non-root container writes its file there), IN PLACE, through
    a descriptor: containerd makes a missing bind-mount source of a CRI mount itself
    (0755, root), so after a reboot a container restarted before the daemon made its
    directory has that one mounted already; it is never buried nor replaced (the lock
    directory's rule). True if the mode was changed; OSError when no directory of the
    daemon's user is there (a link is not followed)."""
    if not key.startswith("c-") or "/" in key:
        raise ValueError(f"{key!r} is not a container's cache key")
    path = cache_root(host_dir) / key
    with CACHE_LOCK:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid():
                raise OSError(f"{path} is owned by uid {info.st_uid}, not the daemon's")
            if stat.S_IMODE(info.st_mode) == 0o777:
                return False
            os.fchmod(fd, 0o777)
        finally:
            os.close(fd)
    return True


def release_cache_dir(host_dir: Path, key: str) -> bool:
    """Remove a cache directory and its record (the directory is buried, one rename;
    the reaper deletes it). True if there was something to remove."""
    root = cache_root(host_dir)
    if "/" in key or key in ("", ".", ".."):
        raise ValueError(f"{key!r} is not a cache key")
    with CACHE_LOCK:
        (root / f"{key}.json").unlink(missing_ok=True)
        there = os.path.lexists(root / key)
        if there:
            bury(root, key)
    if there:
        wake(root)
    return there


def _write_record(path: Path, facts: Mapping[str, object]) -> None:
    """The record beside a cache directory. On a full file system (a tenant filled the
    bounded one, docs/security.md) it is left out rather than the container refused:
    the GC then dates the directory by its own time, and only this container's
    HAMi-core lacks room for its file, as every new one's would."""
    data = json.dumps({**facts, "created": time.time()}).encode()
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        with contextlib.suppress(OSError):
            path.unlink()
        log.warning("cache_record_not_written", path=str(path), error=exc.strerror)


def _fresh_cache_dir(host_dir: Path, key: str, facts: Mapping[str, object] | None) -> Path:
    root = cache_root(host_dir)
    path = root / key
    buried = False
    with CACHE_LOCK:
        try:
            os.mkdir(path, 0o777)
        except FileNotFoundError:
            ensure_cache_root(host_dir)
            os.mkdir(path, 0o777)
        except FileExistsError:
            bury(root, key)
            buried = True
            os.mkdir(path, 0o777)
        os.chmod(path, 0o777)  # past the umask: non-root containers write their file here
        if facts is not None:
            _write_record(root / f"{key}.json", facts)
    if buried:
        wake(root)
    return path
