"""The MPS control daemon's directories, checked and cleared before every (re)start.

The control daemon and the servers it starts run as root and create sockets, a pid file
and (v3) a directory per server and per namespace in the pipe directory; clients of every
container pass work through the shared ``shm`` directory. A container reaches the pipe
directory (or, with v3 namespaces, its own namespace's directory) through a READ-ONLY
bind mount (``share/answers.py``): it can connect to the sockets there, never plant
anything. What a tenant could still have left (a container started before the mount was
read-only, or the ``shm`` directory, which clients must write) is cleared here before the
daemon starts again, so that a root process never writes where a tenant chose:

* each directory of ours (``mps/``, ``pipe``, ``log``, ``shm``) must be a real directory
  owned by the daemon, not a link: anything else is removed and a fresh one made; its
  mode is set through a descriptor opened without following a link;
* in the pipe tree every entry that is not a directory is removed (the previous daemon
  is gone: its sockets and pid file are stale, the new one makes its own); directories
  are kept (a running container's namespace mount stays the same inode) if they are
  real, ours, and at most two levels deep (``<server>/<namespace>``), else removed;
* in ``shm`` every link, FIFO, socket and device node is removed (segments are plain
  files, which the servers open by name and a tenant can only fill, not redirect).

Nothing here follows a link or opens a FIFO: every step works on ``lstat`` results and
directory descriptors (``dir_fd``), so a tenant's plant can make it neither write
elsewhere nor block.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

#: How deep real directories may nest under the pipe directory (v3: server, namespace).
PIPE_DEPTH = 2
#: The pid file is a decimal number; anything longer is not one.
PID_FILE_MAX = 32


def ensure_own_dir(path: Path, mode: int) -> None:
    """``path`` as a real directory owned by this process with ``mode``; anything else
    there (a link, a file, a FIFO, another uid's directory) is removed first. The parent
    must already be ours (callers go from the top down)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None and not (stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()):
        _remove(path, info)
        log.warning("mps_dir_replaced", path=str(path), found=_kind(info.st_mode))
        info = None
    if info is None:
        os.mkdir(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def clear_pipe_tree(pipe_dir: Path) -> list[str]:
    """Remove every non-directory entry under ``pipe_dir`` and every directory that is
    not a real one of ours within :data:`PIPE_DEPTH`; the paths removed (relative)."""
    removed: list[str] = []
    fd = os.open(pipe_dir, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY)
    try:
        _clear(fd, "", 0, removed)
    finally:
        os.close(fd)
    if removed:
        log.warning("mps_pipe_dir_cleared", path=str(pipe_dir), removed=removed[:20])
    return removed


def _clear(dir_fd: int, prefix: str, depth: int, removed: list[str]) -> None:
    for name in os.listdir(dir_fd):
        info = os.lstat(name, dir_fd=dir_fd)
        where = f"{prefix}{name}"
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and depth < PIPE_DEPTH:
            try:
                sub = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=dir_fd)
            except OSError:  # swapped for something else meanwhile: removed below
                pass
            else:
                try:
                    _clear(sub, f"{where}/", depth + 1, removed)
                finally:
                    os.close(sub)
                continue
        _remove_at(dir_fd, name, info)
        removed.append(where)


def clear_shm(shm_dir: Path) -> list[str]:
    """Remove links, FIFOs, sockets and device nodes from ``shm_dir`` (top level: POSIX
    shared memory names have no ``/``); the names removed."""
    removed: list[str] = []
    fd = os.open(shm_dir, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY)
    try:
        for name in os.listdir(fd):
            info = os.lstat(name, dir_fd=fd)
            if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
                continue
            _remove_at(fd, name, info)
            removed.append(name)
    finally:
        os.close(fd)
    if removed:
        log.warning("mps_shm_cleared", path=str(shm_dir), removed=removed[:20])
    return removed


def read_pid_file(path: Path) -> int | None:
    """The pid in ``path`` if it is a small regular file of ours holding a number; never
    follows a link, never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        text = os.read(fd, PID_FILE_MAX + 1).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() and len(text) <= PID_FILE_MAX else None


def _remove(path: Path, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path)  # fd-based on Linux: never follows a link inside
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _remove_at(dir_fd: int, name: str, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "link"),
        (stat.S_ISDIR, "another uid's directory"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISREG, "file"),
    ):
        if test(mode):
            return name
    return "device"
