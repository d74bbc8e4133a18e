"""The holder directories of DRA claim shares on ``driver`` cards: one live container
per share.

The driver's memory limit is set per container (the memory hook puts it on the
container's own cgroup), while a claim is charged once: two containers using one claim
(every container of a pod that names it, or pods reserving one named claim) would each
get the whole charge. So when a claim's share of a ``driver`` card is prepared, the daemon
makes one directory for it here, ``<host-lib-dir>/claimholders/<key>`` (0700, root's, on
the host's own disk: outside the tenants' bounded file system, which a tenant can fill,
and outside everything a container mounts), and names it in the memory hook's arguments
(``--holder``). The hook, at ``createRuntime``, records there the cgroup of the container
that holds the share under ``flock`` and refuses a second container while the first one's
cgroup still holds a process (``hook/memory-hook.c``; docs/dra.md). The daemon never
reads the record: it only makes the directory and removes it when the claim is
unprepared.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

HOLDERS_DIR_NAME = "claimholders"
#: the files the hook writes in a holder directory (and nothing else is ever there)
HOLDER_FILES = ("holder", "holder.new", "lock")
PRIVATE_MODE = 0o700


def holders_root(host_dir: Path) -> Path:
    """``<host_dir>/claimholders``: the parent of every holder directory."""
    return host_dir / HOLDERS_DIR_NAME


def holder_dir(host_dir: Path, key: str) -> Path:
    """The holder directory of the claim share whose cache key is ``key``."""
    if "/" in key or key in ("", ".", ".."):
        raise ValueError(f"{key!r} is not a claim key")
    return holders_root(host_dir) / key


def make_holder_dir(path: Path) -> None:
    """Make ``path`` (and its parent) private to the daemon, or keep it as it is when it
    is already there (a recovered claim's running container holds its record). OSError
    when something else than the daemon's own directory stands there."""
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    for here in (path.parent, path):
        with contextlib.suppress(FileExistsError):
            os.mkdir(here, PRIVATE_MODE)
        info = os.lstat(here)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise OSError(f"{here} is not a directory of the daemon's own")
        if stat.S_IMODE(info.st_mode) != PRIVATE_MODE:
            os.chmod(here, PRIVATE_MODE)


def release_holder_dir(path: Path) -> bool:
    """Remove a holder directory and the hook's files in it (no link followed: they are
    unlinked by name). True if it was there."""
    if not os.path.lexists(path):
        return False
    if os.path.islink(path) or not path.is_dir():
        path.unlink()
        return True
    for name in HOLDER_FILES:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path / name)
    os.rmdir(path)
    return True
