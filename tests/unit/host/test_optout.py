"""Applying the uninstall's plan to a real host directory (``host/optout.py``): what it
sees there, what it removes (directories buried and reaped through no link, files
unlinked), and what it never touches."""

from __future__ import annotations

import os
from pathlib import Path

from gpushare.host.optout import held_by, remove_leftovers, seen_in
from gpushare.share.records import Snapshot

A = "a" * 12
KEY = "1" * 20


def lay_out(host: Path) -> None:
    """A host directory as a daemon leaves it, a tenant's cache directory included."""
    (host / "containers" / f"c-{KEY}" / "deep").mkdir(parents=True)
    (host / "containers" / f"c-{KEY}" / "deep" / "cache").write_bytes(b"x" * 100)
    (host / "containers" / f"c-{KEY}.json").write_text("{}")
    (host / "containers" / "vgpulock").mkdir()
    (host / f"libvgpu.so.{A}").write_bytes(b"\x7fELF")
    (host / "memory-unit.json").write_text("{}")
    (host / "operators-notes.txt").write_text("not gpushare's")


def test_what_it_sees_is_what_is_there(tmp_path: Path) -> None:
    lay_out(tmp_path)
    seen = seen_in(tmp_path)
    assert {f"libvgpu.so.{A}", "memory-unit.json", "containers"} <= seen.top
    assert seen.containers == {f"c-{KEY}", f"c-{KEY}.json", "vgpulock"}
    assert held_by(Snapshot(0.0)).cache_keys == frozenset()


def test_with_no_container_left_only_what_it_did_not_write_stays(tmp_path: Path) -> None:
    lay_out(tmp_path)
    remove_leftovers(tmp_path, Snapshot(0.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["operators-notes.txt"]


def test_a_tenants_planted_link_is_removed_not_followed(tmp_path: Path) -> None:
    host = tmp_path / "vgpu"
    host.mkdir()
    lay_out(host)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("a host file")
    os.symlink(outside, host / "containers" / f"c-{KEY}" / "deep" / "escape")
    remove_leftovers(host, Snapshot(0.0))
    assert (outside / "keep").read_text() == "a host file"
    assert not (host / "containers").exists()
