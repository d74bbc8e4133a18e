"""The kit's one stream of a health board (base/kubeletgrpc.board_stream), the loop of
both ListAndWatch and the DRA health stream: a message at once and after each change,
the same again when quiet only if asked, the board forgotten when the stream ends."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from gpushare.base.kubeletgrpc import board_stream
from gpushare.gpu.health import HealthBoard


def run(board: HealthBoard, *, resend: bool, wanted: int, act: dict[int, object]) -> list[int]:
    """The versions the stream sends until ``wanted`` messages came; ``act[n]`` (a
    callable) runs, from another thread, after the n-th message."""
    stopping = threading.Event()
    sent: list[int] = []

    async def main() -> None:
        stream = board_stream(
            board, stopping, lambda: board.version, 0.05, resend_when_quiet=resend
        )
        async with contextlib.aclosing(stream) as messages:
            async for version in messages:
                sent.append(version)
                if len(sent) >= wanted:
                    break
                step = act.get(len(sent))
                if callable(step):
                    threading.Thread(target=step).start()

    asyncio.run(asyncio.wait_for(main(), 30.0))
    return sent


def test_a_message_at_once_then_after_each_change() -> None:
    board = HealthBoard(["GPU-a"])
    sent = run(board, resend=False, wanted=3, act={
        1: lambda: board.set("GPU-a", False, "XID 79"),
        2: lambda: board.set("GPU-a", True),
    })  # fmt: skip
    assert sent == [0, 1, 2]
    assert board.listeners == []  # forgotten once the stream ended


def test_a_quiet_board_is_sent_again_only_when_asked() -> None:
    board = HealthBoard(["GPU-a"])
    assert run(board, resend=True, wanted=3, act={}) == [0, 0, 0]


def test_the_stream_ends_when_stopping_is_set() -> None:
    board = HealthBoard(["GPU-a"])
    stopping = threading.Event()
    sent: list[int] = []

    async def main() -> None:
        async for version in board_stream(board, stopping, lambda: board.version, 0.05):
            sent.append(version)
            stopping.set()
            board.wake()

    asyncio.run(asyncio.wait_for(main(), 30.0))
    assert sent == [0] and board.listeners == []
