"""Per-card health: the board the device lists are built from.

Every change bumps a version number and wakes whoever waits on the board (the
ListAndWatch streams), so a card going bad reaches the kubelet at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import structlog

log = structlog.get_logger(__name__)


class HealthBoard:
    """Thread-safe map card UUID -> healthy, with change notification."""

    def __init__(self, uuids: Iterable[str]) -> None:
        self._healthy = dict.fromkeys(uuids, True)
        self._reasons: dict[str, str] = {}
        self._changed = threading.Condition()
        self.version = 0

    def is_healthy(self, uuid: str) -> bool:
        return self._healthy.get(uuid, False)

    def healthy_cards(self) -> list[str]:
        return [uuid for uuid, ok in self._healthy.items() if ok]

    def reason(self, uuid: str) -> str:
        return self._reasons.get(uuid, "")

    def set(self, uuid: str, healthy: bool, reason: str = "") -> bool:
        """Record a card's health; True if it changed."""
        with self._changed:
            if uuid not in self._healthy or self._healthy[uuid] == healthy:
                return False
            self._healthy[uuid] = healthy
            if healthy:
                self._reasons.pop(uuid, None)
            else:
                self._reasons[uuid] = reason
            self.version += 1
            self._changed.notify_all()
        log.warning("gpu_health_changed", gpu=uuid, healthy=healthy, reason=reason)
        return True

    def wake(self) -> None:
        """Wake every waiter to re-check its own reason to stop; changes nothing."""
        with self._changed:
            self._changed.notify_all()

    def wait_for_change(
        self, seen: int, timeout: float, give_up: Callable[[], bool] = lambda: False
    ) -> int:
        """Block until the version differs from ``seen``, ``give_up()`` holds (checked
        whenever :meth:`wake` is called) or ``timeout`` passes."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != seen or give_up(), timeout)
            return self.version
