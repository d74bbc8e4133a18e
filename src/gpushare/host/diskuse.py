"""How much disk a tenant-written directory takes, measured with bounded work.

A container's cache directory lies on the host's filesystem and nothing the daemon may
do (no CAP_SYS_ADMIN: no quota, no tmpfs mount) stops a tenant from filling it. So it
is measured, reported as a metric and logged when it passes a limit (docs/security.md).
The measurement is iterative, never follows a link, opens at most ``MAX_DEPTH``
directories at a time and looks at no more than ``max_entries`` entries: a tree built
to make it slow yields a lower bound marked incomplete, which is reason enough to
report it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

#: Directories deeper than this are not entered (their own blocks still count).
MAX_DEPTH = 32
#: Entries looked at per directory measured; a cache directory holds one or two files.
MAX_ENTRIES = 2000


@dataclass(frozen=True)
class Usage:
    bytes: int  # allocated on disk (st_blocks), not apparent size: sparse files are cheap
    entries: int
    complete: bool  # False when a bound was hit or an entry could not be read


def _blocks(info: os.stat_result) -> int:
    return int(info.st_blocks) * 512


def measure(parent_fd: int, name: str, *, max_entries: int = MAX_ENTRIES) -> Usage:
    """Bytes and entries of the tree ``name`` in ``parent_fd`` (the root included)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return Usage(0, 0, False)
    total, entries, complete = _blocks(info), 0, True
    if not stat.S_ISDIR(info.st_mode):
        return Usage(total, 0, True)
    try:
        root = os.open(name, flags, dir_fd=parent_fd)
    except OSError:
        return Usage(total, 0, False)
    # A stack of (open directory, its listing): one descriptor per level.
    stack = [(root, os.scandir(root))]
    try:
        while stack:
            fd, listing = stack[-1]
            entry = next(listing, None)
            if entry is None:
                listing.close()
                os.close(fd)
                stack.pop()
                continue
            if entries >= max_entries:
                complete = False
                break
            entries += 1
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                complete = False
                continue
            total += _blocks(info)
            if not stat.S_ISDIR(info.st_mode):
                continue
            if len(stack) >= MAX_DEPTH:
                complete = False
                continue
            try:
                child = os.open(entry.name, flags, dir_fd=fd)
            except OSError:
                complete = False
                continue
            stack.append((child, os.scandir(child)))
    finally:
        for fd, listing in stack:
            listing.close()
            os.close(fd)
    return Usage(total, entries, complete)
