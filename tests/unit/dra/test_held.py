"""gpushare.dra.held: the in-memory map of prepared claims says whether a change changed
anything (so the node's state is republished only then), lists entries by UID, and
replacing all of it does not alias the caller's dict."""

from __future__ import annotations

from gpushare.dra.checkpoint import ClaimEntry
from gpushare.dra.held import HeldClaims


def entry(name: str, state: str = "prepared") -> ClaimEntry:
    return ClaimEntry(namespace="ns", name=name, state=state, spec_name=f"spec-{name}")


def test_remember_says_whether_anything_changed() -> None:
    held = HeldClaims()
    assert held.remember("b", entry("b")) is True
    assert held.remember("b", entry("b")) is False  # the same entry again
    assert held.remember("b", entry("b", "preparing")) is True
    assert held.remember("a", entry("a")) is True
    assert [e.name for e in held.entries()] == ["a", "b"]  # by UID
    assert held.remember("b", None) is True
    assert held.remember("b", None) is False  # already gone
    assert [e.name for e in held.entries()] == ["a"]


def test_replace_all_copies_and_changed_calls_the_listener() -> None:
    held = HeldClaims()
    mine = {"x": entry("x")}
    held.replace_all(mine)
    mine["y"] = entry("y")
    assert [e.name for e in held.entries()] == ["x"]
    held.changed()  # no listener: nothing happens
    calls: list[int] = []
    held.on_change = lambda: calls.append(1)
    held.changed()
    assert calls == [1]
