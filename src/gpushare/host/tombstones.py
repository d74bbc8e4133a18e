"""Deleting what tenants wrote: rename it to a tombstone, delete it in the background.

A directory a container could write is never emptied in place nor handed to another
container. It is *buried*: renamed to ``<parent>/.tomb-<name>.<run>.<n>`` in the same
parent (one ``rename``, however large the tree: the only work done on the admission
path). The parent is the daemon's own directory and the rename stays inside it, so it
needs no permission on the tenant's directory at all: moving a directory to ANOTHER
parent would need write access to it, which a tenant can take away. A
:class:`Reaper` thread then deletes the tombstones:

* **No recursion, one descriptor.** A non-empty sub-directory met inside a tombstone is
  renamed up into the parent as a tombstone of its own, so a tree 100 000 levels deep
  costs what 100 000 siblings cost, with one directory open at a time.
* **Never through a link.** Everything is addressed relative to its parent's
  descriptor; directories are opened with ``O_NOFOLLOW``; a symbolic link is unlinked,
  never followed; modes are changed through an ``O_PATH`` descriptor, so an entry
  swapped for a link in between is not followed either.
* **Bounded steps.** One step does at most ``budget`` operations and holds no lock
  anyone else takes; the thread pauses between steps and sleeps without a timeout
  when there are no tombstones.
* **Permission games.** An entry the daemon cannot enter, empty or move is made
  accessible first (mode 0700, or 0777 when another uid owns it: the parent is 0700
  root, no one else can reach it). Changing the mode of another uid's entry takes
  ``CAP_FOWNER``, entering it ``CAP_DAC_OVERRIDE``: the DaemonSet keeps both. Without
  them, what cannot be removed stays a tombstone, out of everyone's reach, and is
  reported once (``tombstone_stuck``); it is tried again when :meth:`Reaper.retry`
  is called (every garbage-collection pass).
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import secrets
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

TOMB_PREFIX = ".tomb-"
#: Operations per step (an unlink, rmdir, rename or listed entry each).
STEP_BUDGET = 512
#: Pause between two steps of a long deletion, so other threads get the interpreter.
STEP_PAUSE_SECONDS = 0.002

_RUN = secrets.token_hex(4)  # tombstone names of this process never meet older ones
_SEQUENCE = itertools.count()
_NOT_EMPTY = (errno.ENOTEMPTY, errno.EEXIST)
_DENIED = (errno.EACCES, errno.EPERM)

_reapers: dict[str, Reaper] = {}
_reapers_lock = threading.Lock()


def is_tombstone(name: str) -> bool:
    return name.startswith(TOMB_PREFIX)


def tombstones(parent: Path) -> list[str]:
    return sorted(name for name in os.listdir(parent) if is_tombstone(name))


def _tombstone_name(name: str) -> str:
    base = name.removeprefix(TOMB_PREFIX).split(".", 1)[0][:40]
    return f"{TOMB_PREFIX}{base}.{_RUN}.{next(_SEQUENCE)}"


def bury(parent: Path, name: str) -> str:
    """Rename ``parent/name`` to a tombstone beside it (O(1)); returns the new name.

    ``parent`` must be the daemon's own directory (no one else can write it): the
    rename then works whatever the entry's mode or owner, and moves a link, never
    what it points to. Call :func:`wake` afterwards, outside any lock."""
    tombstone = _tombstone_name(name)
    os.rename(parent / name, parent / tombstone)
    return tombstone


def wake(parent: Path) -> None:
    """Tell the reaper of ``parent``, if one runs, that there is work."""
    with _reapers_lock:
        reaper = _reapers.get(str(parent))
    if reaper is not None:
        reaper.wake()


def _grant(parent_fd: int, name: str) -> bool:
    """Make directory ``name`` (in ``parent_fd``) enterable and writable by the daemon,
    without following a link; False if it is not a directory or cannot be changed."""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode):
            return False
        mode = 0o700 if info.st_uid == os.geteuid() else 0o777
        os.chmod(f"/proc/self/fd/{fd}", mode)  # the inode behind fd, never a link's target
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _open_dir(parent_fd: int, name: str) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=parent_fd)
    except PermissionError:
        if not _grant(parent_fd, name):
            raise
        return os.open(name, flags, dir_fd=parent_fd)


def _retry_granted(op: Callable[[], object], grant: tuple[int, str]) -> None:
    """Run ``op()``; on a permission error make ``grant``'s directory ours and retry."""
    try:
        op()
    except OSError as exc:
        if exc.errno not in _DENIED or not _grant(*grant):
            raise
        op()


def remove_step(trash_fd: int, name: str, budget: int) -> tuple[bool, int]:
    """Work on tombstone ``name`` in directory ``trash_fd``: (gone, operations used).

    Files and links are unlinked; an empty directory is removed; a non-empty one has
    its files unlinked and its sub-directories renamed up beside it (where they are
    tombstones of their own), at most ``budget`` entries per call. Raises OSError for
    what cannot be done."""
    info = os.stat(name, dir_fd=trash_fd, follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(name, dir_fd=trash_fd)
        return True, 1
    try:
        os.rmdir(name, dir_fd=trash_fd)
        return True, 1
    except OSError as exc:
        if exc.errno not in _NOT_EMPTY:
            raise
    used = 1
    fd = _open_dir(trash_fd, name)
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if used >= budget:
                    break
                used += 1
                child = entry.name
                if entry.is_dir(follow_symlinks=False):
                    try:
                        os.rmdir(child, dir_fd=fd)
                        continue
                    except OSError as exc:
                        if exc.errno not in _NOT_EMPTY + _DENIED:
                            raise
                    up = _tombstone_name(name)
                    # moving a directory to another parent needs write access to it
                    _retry_granted(
                        functools.partial(os.rename, child, up, src_dir_fd=fd, dst_dir_fd=trash_fd),
                        (fd, child),
                    )
                else:
                    _retry_granted(functools.partial(os.unlink, child, dir_fd=fd), (trash_fd, name))
    finally:
        os.close(fd)
    return False, used


class Reaper:
    """A thread deleting the tombstones in one directory, a bounded step at a time."""

    def __init__(
        self, parent: Path, *, budget: int = STEP_BUDGET, pause: float = STEP_PAUSE_SECONDS
    ) -> None:
        self.parent = parent
        self.budget = budget
        self.pause = pause
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stuck: dict[str, str] = {}  # tombstone -> why, skipped until retry()
        self._reported: set[str] = set()
        self.operations = 0  # unlinks, removals, renames and listed entries, for tests

    @property
    def stuck(self) -> dict[str, str]:
        return dict(self._stuck)

    def start(self) -> None:
        with _reapers_lock:
            _reapers[str(self.parent)] = self
        self._thread = threading.Thread(target=self._run, name="reaper", daemon=True)
        self._thread.start()
        self._wake.set()  # tombstones left by an earlier run

    def stop(self) -> None:
        with _reapers_lock:
            if _reapers.get(str(self.parent)) is self:
                del _reapers[str(self.parent)]
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def wake(self) -> None:
        self._wake.set()

    def retry(self) -> None:
        """Try the tombstones that could not be removed again."""
        if self._stuck:
            self._stuck.clear()
            self._wake.set()

    def step(self) -> bool:
        """One bounded step; True while there is more to do (stuck tombstones aside)."""
        try:
            trash_fd = os.open(
                self.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError:
            return False
        budget = self.budget
        more = False
        try:
            with os.scandir(trash_fd) as entries:
                for entry in entries:
                    if budget <= 0:
                        return True
                    name = entry.name
                    if not is_tombstone(name) or name in self._stuck:
                        continue
                    try:
                        gone, used = remove_step(trash_fd, name, budget)
                    except FileNotFoundError:
                        continue
                    except OSError as exc:
                        self._stuck_on(name, exc)
                        continue
                    budget -= used
                    self.operations += used
                    more = more or not gone
            return more
        finally:
            os.close(trash_fd)

    def drain(self) -> None:
        """Step until nothing but stuck tombstones is left (for tests and shutdown)."""
        while self.step():
            pass

    def _stuck_on(self, name: str, exc: OSError) -> None:
        why = f"{exc.strerror or exc}"
        self._stuck[name] = why
        if name not in self._reported:
            self._reported.add(name)
            log.warning(
                "tombstone_stuck",
                parent=str(self.parent),
                tombstone=name,
                error=why,
                hint="deleting entries of other uids needs CAP_DAC_OVERRIDE and CAP_FOWNER",
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            while not self._stop.is_set():
                try:
                    more = self.step()
                except Exception:  # a reaper never dies of what a tenant left
                    log.exception("reaper_step_failed", parent=str(self.parent))
                    more = False
                if not more:
                    break
                self._stop.wait(self.pause)
