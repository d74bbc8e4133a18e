"""The pod's card choice (``use-gputype`` & co., see ``gputype.py``) applied to a node's
cards before the fit: cards the annotations exclude are given no share of the pod."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpushare.extender.fit import CardRoom
from gpushare.kube.nodestate import NodeGpuState
from gpushare.share.gputype import CardChoice, card_choice


def excluded_rooms(
    rooms: Sequence[CardRoom], state: NodeGpuState, choice: CardChoice | None
) -> tuple[tuple[CardRoom, ...], list[str]]:
    """``rooms`` with the excluded cards taken out of the fit (marked unusable), and the
    labels of those cards (``GPU0 (Tesla T4)``) for the reason a node is refused."""
    if choice is None:
        return tuple(rooms), []
    names = {card.uuid: card.name for card in state.cards}
    kept, excluded = [], []
    for room in rooms:
        name = names.get(room.uuid, "")
        if choice.allows(name, room.uuid):
            kept.append(room)
        else:
            kept.append(replace(room, healthy=False))
            excluded.append(f"{room.label} ({name})")
    return tuple(kept), excluded


def card_choice_of(pod: Mapping[str, Any], prefix: str) -> CardChoice | None:
    """The pod's choice, or None when its annotations make none."""
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    choice = card_choice(annotations if isinstance(annotations, Mapping) else None, prefix)
    return choice or None
