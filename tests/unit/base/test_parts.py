"""gpushare.base.parts: parts start in order and stop in reverse, a part whose start
raises is not stopped, readiness is the first unready part's reason, and each start is
timed under its name."""

from __future__ import annotations

import pytest

from gpushare.base.parts import Parts, Task


class Recorded:
    def __init__(self, name: str, journal: list[str], ready: bool = True, fail: bool = False):
        self.name, self.journal, self._ready, self.fail = name, journal, ready, fail

    def start(self) -> None:
        if self.fail:
            raise RuntimeError(f"{self.name} cannot start")
        self.journal.append(f"start {self.name}")

    def stop(self) -> None:
        self.journal.append(f"stop {self.name}")

    def ready(self) -> tuple[bool, str]:
        return self._ready, "" if self._ready else f"{self.name} not ready"


def test_parts_stop_in_reverse_and_a_failed_start_is_not_stopped() -> None:
    journal: list[str] = []
    parts = Parts()
    parts.launch(Recorded("a", journal))
    parts.launch(Recorded("b", journal))
    with pytest.raises(RuntimeError):
        parts.launch(Recorded("c", journal, fail=True))
    assert parts.names == ("a", "b")
    assert set(parts.start_ms) == {"a", "b"} and all(ms >= 0 for ms in parts.start_ms.values())
    parts.stop_all()
    assert journal == ["start a", "start b", "stop b", "stop a"]
    assert parts.names == ()
    parts.stop_all()  # nothing left: nothing stopped twice
    assert journal[-1] == "stop a" and len(journal) == 4


def test_the_first_unready_part_says_why() -> None:
    journal: list[str] = []
    parts = Parts()
    assert parts.ready() == (True, "ready")
    parts.launch(Recorded("a", journal))
    parts.launch(Recorded("b", journal, ready=False))
    parts.launch(Recorded("c", journal, ready=False))
    assert parts.ready() == (False, "b not ready")


def test_a_task_runs_its_functions_and_is_ready_once_started() -> None:
    calls: list[str] = []
    task = Task("reaper", lambda: calls.append("start"), lambda: calls.append("stop"))
    parts = Parts()
    parts.launch(task)
    assert task.name == "reaper" and task.ready() == (True, "")
    parts.stop_all()
    assert calls == ["start", "stop"]
