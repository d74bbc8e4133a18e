"""The interposer on the host: a versioned copy of libvgpu.so and per-container caches.

The library is installed as ``libvgpu.so.<sha256 prefix>`` and never overwritten:
containers keep the file they started with mounted, and a new version gets a new
name (replacing a file under running containers crashed them in HAMi). Each memory
allocation gets a fresh cache directory, named after the units it holds, with a
small record beside it so that garbage collection knows whose it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from gpushare.answers import CONTAINER_LIBRARY, LOCK_DIR

LIBRARY_NAME = "libvgpu.so"
CACHE_ROOT_NAME = "containers"
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
    try:
        digest = _digest(source)
    except OSError as exc:
        raise LibraryError(
            f"cannot read the interposer library {source}: {exc.strerror}; "
            "set --library, or run with --no-enforcement"
        ) from None
    target = host_dir / f"{LIBRARY_NAME}.{digest}"
    try:
        host_dir.mkdir(parents=True, exist_ok=True)
        if not target.exists() or _digest(target) != digest:
            with source.open("rb") as src:
                _atomic_write(target, lambda out: shutil.copyfileobj(src, out))
    except OSError as exc:
        raise LibraryError(f"cannot install the interposer into {host_dir}: {exc}") from None
    return target


def install_preload_file(library: Path) -> Path:
    """A host file for /etc/ld.so.preload that names the library's container path."""
    target = library.with_name(f"ld.so.preload.{library.name.rsplit('.', 1)[-1]}")
    content = f"{CONTAINER_LIBRARY}\n".encode()
    if not target.exists() or target.read_bytes() != content:
        _atomic_write(target, lambda out: out.write(content))
        os.chmod(target, 0o644)
    return target


def ensure_lock_dir(path: Path = Path(LOCK_DIR)) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o1777)


def cache_key(device_ids: Iterable[str]) -> str:
    """A directory name derived from the memory units a container holds."""
    joined = "\n".join(sorted(device_ids)).encode()
    return "c-" + hashlib.sha256(joined).hexdigest()[:20]


#: Held while a cache directory is created or removed, so that garbage collection
#: never removes one that an Allocate is preparing at the same moment.
CACHE_LOCK = threading.Lock()


def _empty_directory(path: Path) -> None:
    """Remove what is in ``path`` (keeping the directory: cheaper than re-creating it);
    anything there that is not a real directory is replaced by one."""
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        path.unlink()
        os.mkdir(path)
        return
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def prepare_cache_dir(host_dir: Path, device_ids: list[str]) -> Path:
    """A fresh, empty, world-writable cache directory for the container holding these units.

    A directory already there belonged to an earlier holder of the same units (the
    kubelet reuses units only after their container is gone), so it is emptied.
    """
    root = host_dir / CACHE_ROOT_NAME
    key = cache_key(device_ids)
    path = root / key
    record = json.dumps({"device_ids": sorted(device_ids), "created": time.time()})
    with CACHE_LOCK:
        try:
            os.mkdir(path)
        except FileNotFoundError:
            root.mkdir(parents=True, exist_ok=True)
            os.mkdir(path)
        except FileExistsError:
            _empty_directory(path)
        os.chmod(path, 0o777)  # non-root containers write their accounting file here
        fd = os.open(root / f"{key}.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, record.encode())
        finally:
            os.close(fd)
    return path
