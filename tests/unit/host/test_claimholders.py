"""The holder directories of DRA claim shares on ``driver`` cards (host/claimholders.py):
private to the daemon, never a tenant's path, made again as they are, removed without
following a link."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.host.claimholders import (
    HOLDER_FILES,
    PRIVATE_MODE,
    holder_dir,
    holders_root,
    make_holder_dir,
    release_holder_dir,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_holder_directory_is_the_daemons_own_and_private(tmp_path: Path) -> None:
    path = holder_dir(tmp_path, "d-1234")
    assert path.parent == holders_root(tmp_path) and path.name == "d-1234"
    make_holder_dir(path)
    assert path.is_dir() and mode(path) == PRIVATE_MODE and mode(path.parent) == PRIVATE_MODE
    assert os.lstat(path).st_uid == os.geteuid()


def test_an_existing_directory_is_kept_with_its_record_and_made_private(tmp_path: Path) -> None:
    path = holder_dir(tmp_path, "d-1")
    make_holder_dir(path)
    (path / "holder").write_text("/kubepods/pod-a/main\n")  # a running container's record
    os.chmod(path, 0o755)  # opened by someone: the daemon closes it again
    make_holder_dir(path)
    assert (path / "holder").read_text() == "/kubepods/pod-a/main\n"
    assert mode(path) == PRIVATE_MODE


def test_something_else_standing_there_is_refused(tmp_path: Path) -> None:
    path = holder_dir(tmp_path, "d-2")
    path.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    before = mode(elsewhere)
    path.symlink_to(elsewhere)  # a link planted where the directory goes
    with pytest.raises(OSError, match="not a directory of the daemon's own"):
        make_holder_dir(path)
    assert mode(elsewhere) == before  # its target untouched (not made private through it)


@given(st.sampled_from(["", ".", "..", "a/b", "/abs", "../up"]))
def test_a_key_that_is_no_plain_name_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="is not a claim key"):
        holder_dir(Path("/nowhere"), key)


def test_release_removes_the_hooks_files_and_the_directory(tmp_path: Path) -> None:
    path = holder_dir(tmp_path, "d-3")
    make_holder_dir(path)
    for name in HOLDER_FILES:
        (path / name).write_text("x")
    assert release_holder_dir(path)
    assert not path.exists()
    assert not release_holder_dir(path)  # gone already: nothing to do, said so


def test_release_unlinks_a_planted_link_without_following_it(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "holder").write_text("keep me")
    path = holder_dir(tmp_path, "d-4")
    path.parent.mkdir(parents=True)
    path.symlink_to(target)
    assert release_holder_dir(path)
    assert not os.path.lexists(path)
    assert (target / "holder").read_text() == "keep me"


def test_a_hooks_file_that_is_a_link_is_unlinked_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("a host file")
    path = holder_dir(tmp_path, "d-5")
    make_holder_dir(path)
    (path / "holder").symlink_to(outside)
    assert release_holder_dir(path)
    assert outside.read_text() == "a host file" and not path.exists()
