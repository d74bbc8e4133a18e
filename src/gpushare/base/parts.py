"""The daemon is a list of parts: each starts, stops and says whether it is ready.

A part is built from the settings and the node's shared core by the package it belongs
to (the device-plugin front door by :mod:`gpushare.deviceplugin`, the DRA driver by its
own); :class:`Parts` starts them in order, times each start, and stops them in the
reverse order. No part reaches into another part's state: what one needs of another is
handed to it at construction, as a value or a callable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)


class Part(Protocol):
    """Something the daemon runs: started once, stopped once, asked for readiness."""

    @property
    def name(self) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def ready(self) -> tuple[bool, str]:
        """(ready, why not): what /readyz answers for this part."""
        ...


class Parts:
    """The parts started so far, in start order; stopped in reverse."""

    def __init__(self) -> None:
        self._started: list[Part] = []
        self.start_ms: dict[str, float] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(part.name for part in self._started)

    def launch(self, part: Part) -> None:
        """Start ``part`` (timed) and remember to stop it; a part whose start raises is
        not remembered (it cleans up after itself)."""
        began = time.perf_counter()
        part.start()
        self._started.append(part)
        self.start_ms[part.name] = round((time.perf_counter() - began) * 1000, 1)

    def ready(self) -> tuple[bool, str]:
        """The first part not ready, in start order, says why; else ready."""
        for part in self._started:
            ok, why = part.ready()
            if not ok:
                return False, why
        return True, "ready"

    def stop_all(self) -> None:
        while self._started:
            self._started.pop().stop()


class Task:
    """A part made of a start and a stop function, ready as soon as it runs (a
    background thread such as the reaper or the health monitor)."""

    def __init__(
        self, name: str, start: Callable[[], object], stop: Callable[[], object]
    ) -> None:
        self._name, self._start, self._stop = name, start, stop

    @property
    def name(self) -> str:
        return self._name

    def start(self) -> None:
        self._start()

    def stop(self) -> None:
        self._stop()

    def ready(self) -> tuple[bool, str]:
        return True, ""
