"""The host side of removing a killed daemon's sockets: only gpushare's, only sockets,
only where nobody listens (a ``connect(2)`` refused), never the starting instance's own."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.base.kubeletgrpc import Listener, probe_socket, remove_if_unserved
from gpushare.deviceplugin.stalesockets import remove_stale_sockets


def left_behind(path: Path) -> None:
    """A socket nobody listens on, as a killed process leaves it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


@pytest.fixture
def listening(short_tmp: Path) -> Iterator[Path]:
    path = short_tmp / "gpushare-vcuda-core.aaaaaa.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen(1)
        yield path


def test_a_probe_tells_a_served_socket_from_a_left_one(short_tmp: Path, listening: Path) -> None:
    left_behind(short_tmp / "left.sock")
    (short_tmp / "file.sock").write_text("")
    assert probe_socket(listening) is Listener.ANSWERS
    assert probe_socket(short_tmp / "left.sock") is Listener.REFUSED
    assert probe_socket(short_tmp / "file.sock") is Listener.ABSENT
    assert probe_socket(short_tmp / "none.sock") is Listener.ABSENT
    assert not remove_if_unserved(listening) and listening.exists()
    assert not remove_if_unserved(short_tmp / "file.sock")
    assert remove_if_unserved(short_tmp / "left.sock")
    assert not (short_tmp / "left.sock").exists()


def test_only_gpushares_unserved_sockets_of_other_instances_go(
    short_tmp: Path, listening: Path
) -> None:
    stale = ["gpushare-vcuda-memory.bbbbbb.sock", "gpushare-gpu.bbbbbb-3.sock"]
    kept = [
        "gpushare-vcuda-memory.cccccc.sock",  # the starting instance's own name
        ".gpushare-vcuda-memory.bbbbbb.sock.7-1f",  # bound hidden: never ours to remove
        "kubelet.sock",
        "nvidia-gpu.sock",
    ]
    for name in stale + kept:
        left_behind(short_tmp / name)
    (short_tmp / "gpushare-file.sock").write_text("a file")
    (short_tmp / "gpushare-link.sock").symlink_to(short_tmp / stale[0])
    (short_tmp / "gpushare-dir.sock").mkdir()
    removed = remove_stale_sockets(short_tmp, "cccccc")
    assert sorted(removed) == sorted(stale)
    left = {p.name for p in short_tmp.iterdir()}
    assert left == {
        *kept,
        listening.name,
        "gpushare-file.sock",
        "gpushare-link.sock",
        "gpushare-dir.sock",
    }


def test_an_unreadable_directory_removes_nothing(short_tmp: Path) -> None:
    assert remove_stale_sockets(short_tmp / "missing", "cccccc") == []
