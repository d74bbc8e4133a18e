"""Sleep until a directory's entries change, instead of polling it.

:class:`DirWatch` wraps Linux inotify (through ctypes: no dependency) on one
directory, plus a pipe that :meth:`DirWatch.wake` writes to, so that one thread can
block until either a file in the directory is created, removed, replaced or written,
or another thread wants it to look again. Callers always re-check what they care
about after :meth:`DirWatch.wait` returns: a wake-up is a hint, never a fact.

Where inotify is not available (another OS, a seccomp profile, the directory not
there yet), :meth:`DirWatch.wait` returns after ``fallback_seconds`` at the latest,
which is the old polling behaviour.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_IGNORED = 0x8000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

#: Entries appearing, disappearing, being replaced or written; the directory itself going.
MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
)
_EVENT_HEADER = 16  # struct inotify_event: int wd; uint32 mask, cookie, len; then the name

_libc: Any = None
_libc_lock = threading.Lock()


def _inotify() -> Any:
    """libc with the inotify calls, or None where there is none."""
    global _libc
    with _libc_lock:
        if _libc is None:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                libc.inotify_init1.argtypes = [ctypes.c_int]
                libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
                _libc = libc
            except (OSError, AttributeError):
                _libc = False
        return _libc or None


class DirWatch:
    """Blocks a thread until ``directory`` changes or :meth:`wake` is called."""

    def __init__(self, directory: Path, fallback_seconds: float) -> None:
        self.directory = Path(directory)
        self.fallback_seconds = fallback_seconds
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._close_lock = threading.Lock()
        self._fd = -1
        self._watching = False
        libc = _inotify()
        if libc is not None:
            fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
            if fd >= 0:
                self._fd = fd
        self._add_watch()

    @property
    def watching(self) -> bool:
        """True while inotify watches the directory (else waits time out to poll)."""
        return self._watching

    def _add_watch(self) -> None:
        if self._fd < 0 or self._watching:
            return
        wd = _inotify().inotify_add_watch(self._fd, os.fsencode(self.directory), MASK)
        self._watching = wd >= 0

    def wait(self, timeout: float | None) -> bool:
        """Block until the directory changes, :meth:`wake` is called or ``timeout``
        seconds pass (None: no limit while watching). True unless it timed out."""
        self._add_watch()  # the directory may have appeared, or been re-created
        if not self._watching:
            timeout = (
                self.fallback_seconds if timeout is None else min(timeout, self.fallback_seconds)
            )
        fds = [self._wake_read] + ([self._fd] if self._fd >= 0 else [])
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except (OSError, ValueError):  # closed by another thread
            return False
        for fd in ready:
            self._drain(fd)
        return bool(ready)

    def _drain(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            if fd == self._fd:
                self._note_events(data)

    def _note_events(self, data: bytes) -> None:
        offset = 0
        while offset + _EVENT_HEADER <= len(data):
            mask = int.from_bytes(data[offset + 4 : offset + 8], sys.byteorder)
            length = int.from_bytes(data[offset + 12 : offset + 16], sys.byteorder)
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED):
                self._watching = False  # watched again by the next wait, once it exists
            offset += _EVENT_HEADER + length

    def wake(self) -> None:
        """Make a current or the next :meth:`wait` return at once; a no-op once closed."""
        with self._close_lock:  # never write to a closed descriptor's reused number
            if self._wake_write >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._wake_write, b"!")

    def close(self) -> None:
        """Release the descriptors; call once no thread waits any more."""
        with self._close_lock:
            for fd in (self._fd, self._wake_read, self._wake_write):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._fd = self._wake_read = self._wake_write = -1
            self._watching = False


class StopEvent(threading.Event):
    """A :class:`threading.Event` that also calls back when set, so that a thread
    blocked in :meth:`DirWatch.wait` (not on the event) notices a stop at once."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def on_set(self, callback: Callable[[], None]) -> None:
        with self._callbacks_lock:
            self._callbacks.append(callback)
        if self.is_set():
            callback()

    def remove(self, callback: Callable[[], None]) -> None:
        with self._callbacks_lock, contextlib.suppress(ValueError):
            self._callbacks.remove(callback)

    def set(self) -> None:
        super().set()
        with self._callbacks_lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()
