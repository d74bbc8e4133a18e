"""Exclusive and shared use of one node, never of one card at once.

A card can be offered two ways: as shared units (``vcuda-memory``/``vcuda-core``)
and whole (``<prefix>/gpu``). Which ways is fixed per card by ``cardModes``
(:func:`gpushare.share.cardmodes.card_modes`: ``shared``, ``exclusive`` or ``both``,
default ``both``); a
card in one mode only is simply not advertised the other way. For a ``both`` card
the choice is made by use, with the kubelet's own mechanism: while any of its shared
units is held, its whole-card device is listed ``Unhealthy``; while it is held
whole, its shared units are. The kubelet then neither counts nor offers them, and
they come back ``Healthy`` when the holder is gone from its records (PodResources).

:class:`Exclusion` keeps the boards the resources are listed from: each is the
card's hardware health combined with the use of the other kind. Allocate reads the
same boards, so a kubelet acting on a device list older than the last Allocate is
refused instead of putting two kinds of use on one card.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import structlog

from gpushare.gpu.health import HealthBoard
from gpushare.share.devices import Resource
from gpushare.share.usage import UsageLedger
from gpushare.share.whole import ExclusiveLedger, ExclusiveResource

log = structlog.get_logger(__name__)


class Exclusion:
    """Derives the boards the resources are offered from; call :meth:`refresh` after
    anything that may change who holds a card (the hardware board calls it itself).

    * ``shared``: by card UUID, for the cards offered as shared units: healthy when the
      card is and no exclusive device on it is held.
    * each exclusive resource's board, by device ID: healthy when its card is and no
      shared unit of that card is held.
    """

    def __init__(
        self,
        hardware: HealthBoard,
        shared: HealthBoard,
        usage: UsageLedger,
        exclusive: Sequence[tuple[str, ExclusiveResource, HealthBoard]],
        ledger: ExclusiveLedger,
    ) -> None:
        self.hardware = hardware
        self.shared = shared
        self.usage = usage
        self.exclusive = list(exclusive)  # (full resource name, resource, board)
        self.ledger = ledger
        self._lock = threading.Lock()
        hardware.listeners.append(self.refresh)

    def shared_cards_in_use(self) -> set[str]:
        memory = self.usage.used_counts(Resource.MEMORY)
        core = self.usage.used_counts(Resource.CORE)
        return {uuid for uuid in memory if memory[uuid] or core.get(uuid, 0)}

    def exclusive_holdings(self) -> dict[str, str]:
        """Card UUID -> the exclusive resource holding (part of) it."""
        held: dict[str, str] = {}
        for name, resource, _board in self.exclusive:
            for device_id in self.ledger.held(name):
                device = resource.devices.get(device_id)
                if device is not None:
                    held.setdefault(device.parent, name)
        return held

    def refresh(self) -> None:
        with self._lock:
            shared_use = self.shared_cards_in_use()
            whole_use = self.exclusive_holdings()
            for uuid in self.shared.cards():
                holder = whole_use.get(uuid)
                if not self.hardware.is_healthy(uuid):
                    self.shared.set(uuid, False, self.hardware.reason(uuid) or "unhealthy")
                elif holder is not None:
                    self.shared.set(uuid, False, f"in use whole ({holder})")
                else:
                    self.shared.set(uuid, True, "free of exclusive use")
            for _name, resource, board in self.exclusive:
                for device in resource.devices.values():
                    if not self.hardware.is_healthy(device.parent):
                        reason = self.hardware.reason(device.parent) or "unhealthy"
                        board.set(device.id, False, f"card {device.parent}: {reason}")
                    elif device.parent in shared_use:
                        board.set(device.id, False, "its card has shared units in use")
                    else:
                        board.set(device.id, True, "free of shared use")
