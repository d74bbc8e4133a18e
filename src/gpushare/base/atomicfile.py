"""Replacing a small file's content atomically: a temporary file beside it, renamed over.

A reader (the container runtime reading CDI specs, a restarted daemon reading its
checkpoint) sees the old content or the new, never half of one. Nothing is fsynced: a
killed daemon loses nothing (the page cache outlives it), and each caller says why a
power loss is survivable.

The temporary file's name is fixed per process and thread, ``.<name>.<pid>.<thread>.tmp``
(no random name to make: this sits on the DRA prepare path), created with ``O_EXCL``
and ``O_NOFOLLOW`` so that nothing already standing there, a link included, is written
through; a leftover of a killed process that had the same PID is removed first.
"""

from __future__ import annotations

import os
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


def replace_file(target: Path, data: bytes, mode: int, *, dir_mode: int | None = None) -> None:
    """Give ``target`` the content ``data`` and the permission bits ``mode``, atomically;
    a link standing at ``target`` is replaced, never followed. With ``dir_mode``, a
    missing directory is made (parents too) with that mode; without, it is an error."""
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
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
