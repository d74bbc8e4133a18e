"""A size-limited file system for what tenants write: the cache and lock directories,
and the ``/dev/shm`` MPS servers and their clients share.

Every container given memory units gets a read-write cache directory, and all of them
share the lock directory, below ``<host-lib-dir>/containers`` (docs/security.md). On the
host's root file system nothing bounded them: a tenant could write until the node's
disk was full (issue 23 item 6). A size-limited ``tmpfs`` mounted over ``containers``
makes writes fail (``ENOSPC``) at the limit, whatever a tenant does.

Mounting needs ``CAP_SYS_ADMIN``, which the daemon does not have (it keeps only
``CAP_DAC_OVERRIDE`` and ``CAP_FOWNER``), and making the mount visible on the host
needs Bidirectional mount propagation, which only a privileged container may ask. So
the DaemonSet runs this once, as a short privileged init container
(``python -m gpushare.host.cachefs``), before the daemon starts: it mounts the tmpfs
(``nosuid,nodev,noexec``, mode 0700) unless one is already there (a restart), and
exits. The mount lives on the host until the node reboots, so daemon restarts and
upgrades keep it and what is in it. The daemon only reads the bound (:func:`bound`)
and logs it at its first collection.

Cost: tmpfs pages are memory, counted to the writer's memory cgroup, and only as far
as files are written: the interposer's accounting file is 2 008 952 bytes per
container (most of it never touched); a tenant filling the file system ties up at
most the size of it in memory (swap, where the node has it). The bound is shared by
the containers of a node: one tenant can still fill it, denying new containers of
others their cache file until the daemon's collection (or the tenant's end) frees it;
a per-container bound needs a mount per Allocate (``CAP_SYS_ADMIN`` in the daemon),
which gpushare does not take.

The MPS ``/dev/shm`` (``<host-lib-dir>/mps/shm``, ``host/mpsshm.py``) gets a tmpfs of its
own from the same command (``--mps-shm-size-mib``, mode 1777: every client writes
segments there), so that segments and cache files do not take each other's room
(issue 41 item 2).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from gpushare.host.library import PRIVATE_MODE, cache_root
from gpushare.host.mps import SHM_MODE, mps_shm_dir

#: The default bound: 256 containers' accounting files with room to spare.
DEFAULT_SIZE_MIB = 1024
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
SOURCE = "gpushare-cache"
#: The MPS /dev/shm's default bound (Docker gives a container's /dev/shm 64 MiB).
DEFAULT_SHM_SIZE_MIB = 256
SHM_SOURCE = "gpushare-mps-shm"


@dataclass(frozen=True)
class Bound:
    """The file system holding ``containers``: its own (bounded) or the parent's."""

    own: bool
    fs_type: str
    size_bytes: int
    free_bytes: int


def _mount_of(path: Path) -> tuple[str, str] | None:
    """(mount point, type) of the mount at exactly ``path``, from mountinfo."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        fields = line.split(" ")
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        if point == str(path):
            fs_type = line.split(" - ", 1)[1].split(" ")[0]
            found = (point, fs_type)  # the last one listed is the one on top
    return found


def bound(host_dir: Path) -> Bound | None:
    """What bounds the space below ``containers``; None when it does not exist yet."""
    return bound_of(cache_root(host_dir))


def bound_of(root: Path) -> Bound | None:
    """What bounds the space below ``root``; None when it does not exist yet."""
    try:
        info = os.statvfs(root)
    except OSError:
        return None
    mounted = _mount_of(root.resolve())
    return Bound(
        own=mounted is not None,
        fs_type=mounted[1] if mounted else "",
        size_bytes=info.f_blocks * info.f_frsize,
        free_bytes=info.f_bavail * info.f_frsize,
    )


def mount_cache_fs(host_dir: Path, size_mib: int) -> str:
    """Mount a ``size_mib`` tmpfs over ``containers`` unless a file system of its own is
    already there; what was done, in words. Raises OSError (e.g. EPERM without
    CAP_SYS_ADMIN)."""
    return _mount_tmpfs(cache_root(host_dir), size_mib, PRIVATE_MODE, SOURCE)


def mount_shm_fs(host_dir: Path, size_mib: int) -> str:
    """Mount a ``size_mib`` tmpfs (mode 1777) over the MPS ``/dev/shm`` directory unless a
    file system of its own is already there; what was done, in words."""
    return _mount_tmpfs(mps_shm_dir(host_dir), size_mib, SHM_MODE, SHM_SOURCE)


def _mount_tmpfs(root: Path, size_mib: int, mode: int, source: str) -> str:
    root.mkdir(mode=mode, parents=True, exist_ok=True)
    current = bound_of(root)
    if current is not None and current.own:
        return f"{root}: already {current.fs_type} of {current.size_bytes} bytes, kept"
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    options = f"size={size_mib}m,mode={mode:o}".encode()
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if libc.mount(source.encode(), str(root).encode(), b"tmpfs", flags, options) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount tmpfs on {root}: {os.strerror(errno)}")
    return f"{root}: mounted tmpfs of {size_mib} MiB (nosuid,nodev,noexec)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpushare.host.cachefs",
        description="mount a size-limited tmpfs over <host-lib-dir>/containers (once per boot)",
    )
    parser.add_argument("--host-lib-dir", default="/usr/local/vgpu")
    parser.add_argument("--size-mib", type=int, default=DEFAULT_SIZE_MIB)
    parser.add_argument(
        "--mps-shm-size-mib",
        type=int,
        default=0,
        help="the bound of the MPS /dev/shm (<host-lib-dir>/mps/shm; the chart passes "
        f"{DEFAULT_SHM_SIZE_MIB} where MPS is on); 0: not mounted",
    )
    args = parser.parse_args(argv)
    if args.size_mib <= 0 or args.mps_shm_size_mib < 0:
        print("--size-mib must be positive, --mps-shm-size-mib not negative", file=sys.stderr)
        return 2
    try:
        print(mount_cache_fs(Path(args.host_lib_dir), args.size_mib))
        if args.mps_shm_size_mib:
            print(mount_shm_fs(Path(args.host_lib_dir), args.mps_shm_size_mib))
    except OSError as exc:
        print(
            f"cannot bound the cache directories: {exc} (needs CAP_SYS_ADMIN and "
            "Bidirectional mount propagation: a privileged init container)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
