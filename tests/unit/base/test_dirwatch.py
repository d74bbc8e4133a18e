"""DirWatch: the wake-up used by the kubelet link and the simulated NVML backend."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from gpushare.base.dirwatch import DirWatch


def test_a_new_file_wakes_a_waiting_thread(tmp_path: Path) -> None:
    watch = DirWatch(tmp_path, fallback_seconds=30.0)
    woke = threading.Event()

    def waiter() -> None:
        if watch.wait(60.0):
            woke.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        (tmp_path / "kubelet.sock").touch()
        assert woke.wait(30.0)
    finally:
        watch.wake()
        thread.join()
        watch.close()


def test_a_wake_after_close_writes_nowhere(tmp_path: Path) -> None:
    watch = DirWatch(tmp_path, fallback_seconds=1.0)
    watch.close()
    read, write = os.pipe2(os.O_NONBLOCK)  # most likely takes a number the watch held
    try:
        watch.wake()  # e.g. a plugin stream ending during shutdown
        try:
            leaked = os.read(read, 1)
        except BlockingIOError:
            leaked = b""
        assert leaked == b""
    finally:
        os.close(read)
        os.close(write)


def test_close_waits_for_a_wake_that_is_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    watch = DirWatch(tmp_path, fallback_seconds=1.0)
    writing, release = threading.Event(), threading.Event()
    real_write = os.write

    def slow_write(fd: int, data: bytes) -> int:
        writing.set()
        release.wait(30.0)  # the waking thread is preempted between the check and the write
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", slow_write)
    waker = threading.Thread(target=watch.wake)
    waker.start()
    assert writing.wait(30.0)
    closer = threading.Thread(target=watch.close)
    closer.start()
    closer.join(0.2)
    closed_too_early = not closer.is_alive()  # would free the number the write is about to use
    release.set()
    waker.join()
    closer.join()
    assert not closed_too_early
