"""gpushare.node.refresh: a read of the kubelet's records replaces the ledger's view
and tells the listeners; a failed read, an older answer or a hook that raises changes
nothing and never ends the refresher; a poke makes the thread read again soon."""

from __future__ import annotations

import itertools

from kit.procs import eventually

from gpushare.gpu.gpus import Gpu
from gpushare.node.refresh import UsageRefresher
from gpushare.share.devices import Inventory, Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder, UsageLedger

GPUS = [Gpu("GPU-0", "Tesla T4", 4096, 0, 0)]


def holding(taken_at: float, *units: int) -> Snapshot:
    snapshot = Snapshot(taken_at=taken_at)
    holder = Holder("ns", "p", "main")
    ids = [f"GPU-0::{n}" for n in units]
    for device in ids:
        snapshot.holders[(Resource.MEMORY, device)] = holder
    snapshot.devices[holder] = {Resource.MEMORY: ids}
    return snapshot


def test_a_read_replaces_the_view_and_failures_change_nothing() -> None:
    ledger = UsageLedger(Inventory(GPUS, 256))
    clock = itertools.count(10.0)
    answers: list[Snapshot | None] = [holding(100.0, 0, 1, 2), None, holding(0.0, 5)]
    seen: list[Snapshot] = []

    def bad_hook(_: Snapshot) -> None:
        raise RuntimeError("a listener's bug")

    refresher = UsageRefresher(
        lambda: answers.pop(0), ledger, 60.0, after_read=bad_hook, clock=lambda: next(clock)
    )
    refresher.read_listeners.append(seen.append)
    assert refresher.refresh_once() is True  # the hook's error is logged, not raised
    assert ledger.used_counts(Resource.MEMORY) == {"GPU-0": 3} and len(seen) == 1
    assert refresher.refresh_once() is False and refresher.failures == 1
    assert refresher.refresh_once() is True  # an older answer: nothing new adopted
    assert ledger.used_counts(Resource.MEMORY) == {"GPU-0": 3}
    assert refresher.reads == 1 and len(seen) == 1


def test_a_poke_reads_again_soon_and_stop_ends_the_thread() -> None:
    ledger = UsageLedger(Inventory(GPUS, 256))
    reads: list[int] = []

    def read() -> Snapshot:
        reads.append(1)
        return holding(float("inf"), *range(len(reads)))

    refresher = UsageRefresher(read, ledger, 3600.0)  # left alone it would wait an hour
    refresher.start()
    try:
        refresher.poke()
        eventually(lambda: refresher.reads >= 1)
        assert ledger.used_counts(Resource.MEMORY)["GPU-0"] == len(reads)
    finally:
        refresher.stop()
    assert refresher._thread is not None and not refresher._thread.is_alive()
