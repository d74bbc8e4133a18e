"""Replacing a small file's content atomically: a temporary file beside it, renamed over.

A reader (the container runtime reading CDI specs, a restarted daemon reading its
checkpoint) sees the old content or the new, never half of one. A killed daemon loses
nothing (the page cache outlives it); a power loss can, unless the write is
``durable``: then the file is fsynced before the rename and its directory after, so
the name holds the old content or the new, complete, even after a power cut (the DRA
driver's checkpoint and CDI specs).

:func:`read_small_file` is the matching read of a file in a directory someone else may
have planted things in: never through a link, never blocking on a FIFO, only a regular
file, only up to a bound.

The temporary file's name is fixed per process and thread, ``.<name>.<pid>.<thread>.tmp``
(no random name to make: this sits on the DRA prepare path), created with ``O_EXCL``
and ``O_NOFOLLOW`` so that nothing already standing there, a link included, is written
through; a leftover of a killed process that had the same PID is removed first.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _create(tmp: Path, mode: int) -> int:
    try:
        fd = os.open(tmp, _CREATE, mode)
    except FileExistsError:
        tmp.unlink()
        fd = os.open(tmp, _CREATE, mode)
    try:
        os.fchmod(fd, mode)  # past the umask
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_file(
    target: Path, data: bytes, mode: int, *, dir_mode: int | None = None, durable: bool = False
) -> None:
    """Give ``target`` the content ``data`` and the permission bits ``mode``, atomically;
    a link standing at ``target`` is replaced, never followed. With ``dir_mode``, a
    missing directory is made (parents too) with that mode; without, it is an error.
    ``durable``: fsync the file before the rename and the directory after it."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = _create(tmp, mode)
    except FileNotFoundError:
        if dir_mode is None:
            raise
        target.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
        fd = _create(tmp, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        sync_directory(target.parent)


def sync_directory(directory: Path) -> None:
    """fsync a directory, so that a rename or unlink in it survives a power loss."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NotARegularFile(OSError):
    """What stands at the path is a directory, a FIFO, a device or a socket."""


_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def read_small_file(path: Path, limit: int) -> bytes:
    """The content of the regular file at ``path``, at most ``limit`` bytes: opened
    without following a link (ELOOP) and without blocking (a FIFO opens at once and is
    refused), checked to be a regular file, refused when larger than ``limit``. Raises
    OSError (FileNotFoundError when nothing is there, :class:`NotARegularFile`)."""
    fd = os.open(path, _READ)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(f"{path} is not a regular file")
        if info.st_size > limit:
            raise OSError(f"{path} is larger than {limit} bytes ({info.st_size})")
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise OSError(f"{path} is larger than {limit} bytes")
        return data
    finally:
        os.close(fd)
