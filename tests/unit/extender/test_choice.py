"""gpushare.extender.choice: the pod's card choice (``use-gputype`` & co.) marks the cards
it excludes unusable in the fit, names them for the refusal, and keeps every other
card as it was; a pod without such annotations makes no choice at all."""

from __future__ import annotations

from typing import Any

from gpushare.extender.choice import card_choice_of, excluded_rooms
from gpushare.extender.fit import CardRoom
from gpushare.kube.nodestate import CardState, NodeGpuState

PREFIX = "example.com"
NAMES = ("Tesla T4", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB")


def state() -> NodeGpuState:
    cards = tuple(
        CardState(f"GPU-{i}", i, name, 16384, 64, 0, 100, 0, True) for i, name in enumerate(NAMES)
    )
    return NodeGpuState(1, "", 256, cards)


ROOMS = [CardRoom(f"GPU-{i}", i, 64, 64, 100) for i in range(3)]


def pod(annotations: dict[str, Any] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"metadata": meta}


def test_a_pod_without_annotations_makes_no_choice_and_keeps_every_card() -> None:
    for plain in (pod(None), pod({}), pod({"other": "x"}), {}, {"metadata": "junk"}):
        assert card_choice_of(plain, PREFIX) is None
    assert excluded_rooms(ROOMS, state(), None) == (tuple(ROOMS), [])


def test_excluded_cards_are_unusable_and_named() -> None:
    choice = card_choice_of(pod({f"{PREFIX}/use-gputype": "A100"}), PREFIX)
    assert choice is not None
    rooms, excluded = excluded_rooms(ROOMS, state(), choice)
    assert [room.healthy for room in rooms] == [False, True, True]
    assert rooms[1:] == tuple(ROOMS[1:])  # the others untouched
    assert rooms[0].memory_free == ROOMS[0].memory_free  # only unusable, not emptied
    assert excluded == ["GPU0 (Tesla T4)"]


def test_uuid_and_type_exclusions_add_up() -> None:
    choice = card_choice_of(
        pod({f"{PREFIX}/nouse-gputype": "80GB", f"{PREFIX}/nouse-gpuuuid": "gpu-0"}), PREFIX
    )
    assert choice is not None
    rooms, excluded = excluded_rooms(ROOMS, state(), choice)
    assert [room.healthy for room in rooms] == [False, True, False]
    assert excluded == ["GPU0 (Tesla T4)", "GPU2 (NVIDIA A100-SXM4-80GB)"]
