"""gpushare.share.exclusion: a card offered both ways is never in shared and whole use
at once: while a shared unit of it is held its whole device is listed unhealthy, while
it is held whole its shared units are, a sick card is unhealthy both ways, and the
boards follow the hardware board's changes by themselves."""

from __future__ import annotations

from gpushare.gpu.gpus import Gpu
from gpushare.gpu.health import HealthBoard
from gpushare.share.devices import Inventory, Resource
from gpushare.share.exclusion import Exclusion
from gpushare.share.usage import UsageLedger
from gpushare.share.whole import ExclusiveLedger, whole_cards

GPUS = [Gpu(uuid=f"GPU-{i}", name="Tesla T4", memory_mib=4096, index=i, minor=i) for i in range(3)]
WHOLE = "example.com/gpu"


class World:
    def __init__(self) -> None:
        uuids = [gpu.uuid for gpu in GPUS]
        self.hardware = HealthBoard(uuids)
        self.shared = HealthBoard(uuids)
        self.usage = UsageLedger(Inventory(GPUS, 256))
        self.whole_board = HealthBoard(uuids)
        self.ledger = ExclusiveLedger()
        self.exclusion = Exclusion(
            self.hardware,
            self.shared,
            self.usage,
            [(WHOLE, whole_cards(GPUS), self.whole_board)],
            self.ledger,
        )

    def healthy(self) -> tuple[list[str], list[str]]:
        return self.shared.healthy_cards(), self.whole_board.healthy_cards()


def test_shared_use_takes_the_card_out_of_whole_use_and_whole_use_out_of_shared() -> None:
    world = World()
    world.exclusion.refresh()
    assert world.healthy() == (["GPU-0", "GPU-1", "GPU-2"], ["GPU-0", "GPU-1", "GPU-2"])
    world.usage.record_allocation(Resource.CORE, "GPU-0", [0, 1])  # core alone counts
    world.ledger.record(WHOLE, ["GPU-1"])
    world.exclusion.refresh()
    assert world.healthy() == (["GPU-0", "GPU-2"], ["GPU-1", "GPU-2"])
    assert world.shared.reason("GPU-1") == f"in use whole ({WHOLE})"
    assert world.whole_board.reason("GPU-0") == "its card has shared units in use"
    assert world.exclusion.shared_cards_in_use() == {"GPU-0"}
    assert world.exclusion.exclusive_holdings() == {"GPU-1": WHOLE}


def test_released_cards_come_back_both_ways() -> None:
    world = World()
    world.usage.record_allocation(Resource.MEMORY, "GPU-2", [3])
    world.exclusion.refresh()
    assert "GPU-2" not in world.whole_board.healthy_cards()
    world.usage.replace({}, {}, taken_at=float("inf"))  # the records: nobody holds it
    world.exclusion.refresh()
    assert world.healthy() == (["GPU-0", "GPU-1", "GPU-2"], ["GPU-0", "GPU-1", "GPU-2"])


def test_a_sick_card_is_unhealthy_both_ways_at_once_and_back_when_it_recovers() -> None:
    world = World()
    world.exclusion.refresh()
    world.hardware.set("GPU-1", False, "XID 79")  # the listener refreshes
    assert world.healthy() == (["GPU-0", "GPU-2"], ["GPU-0", "GPU-2"])
    assert world.shared.reason("GPU-1") == "XID 79"
    assert world.whole_board.reason("GPU-1") == "card GPU-1: XID 79"
    world.hardware.set("GPU-1", True)
    assert world.healthy() == (["GPU-0", "GPU-1", "GPU-2"], ["GPU-0", "GPU-1", "GPU-2"])
