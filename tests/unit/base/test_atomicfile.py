"""``replace_file``: whole content or none, the mode asked for, and no link followed."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from gpushare.base.atomicfile import replace_file


def _tmp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def test_content_and_mode_past_the_umask(tmp_path: Path) -> None:
    target = tmp_path / "spec.json"
    old = os.umask(0o077)
    try:
        replace_file(target, b"first", 0o644)
        replace_file(target, b"second", 0o644)
    finally:
        os.umask(old)
    assert target.read_bytes() == b"second"
    assert target.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]  # no temporary left


def test_a_missing_directory_is_made_only_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "entry.json"
    with pytest.raises(FileNotFoundError):
        replace_file(target, b"x", 0o600)
    replace_file(target, b"x", 0o600, dir_mode=0o700)
    assert target.read_bytes() == b"x"
    assert target.parent.stat().st_mode & 0o777 == 0o700


def test_a_link_at_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    target = tmp_path / "spec.json"
    target.symlink_to(victim)
    replace_file(target, b"new", 0o644)
    assert victim.read_bytes() == b"keep"
    assert not target.is_symlink() and target.read_bytes() == b"new"


def test_a_link_at_the_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    target = tmp_path / "entry.json"
    _tmp_name(target).symlink_to(victim)  # planted, or left by a killed process
    replace_file(target, b"new", 0o600)
    assert victim.read_bytes() == b"keep"
    assert target.read_bytes() == b"new"
    assert not _tmp_name(target).exists() and not _tmp_name(target).is_symlink()


def test_a_failed_write_leaves_the_old_content_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "entry.json"
    replace_file(target, b"old", 0o600)
    (tmp_path / "sub").mkdir()
    with pytest.raises(IsADirectoryError):
        replace_file(tmp_path / "sub", b"new", 0o600)  # the rename over a directory fails
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.json", "sub"]
