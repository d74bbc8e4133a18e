"""gpushare.node.cardfacts: what the node publishes beyond the shared units, read at
call time: the cards not offered as shared units with who holds them whole, each
time-sliced card's replicas and holders, the shared cards' own health, and no holds at
all before the kubelet's records are read."""

from __future__ import annotations

from gpushare.gpu.gpus import Gpu
from gpushare.gpu.health import HealthBoard
from gpushare.node.cardfacts import CardFacts, mig_resource_names
from gpushare.node.discovery import plan_gpus
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder

GPUS = [Gpu(f"GPU-{i}", "Tesla T4", 15360, i, i) for i in range(3)]
WHOLE, SLICED = "example.com/gpu", "example.com/gpu.shared"


def facts(records: Snapshot | None) -> tuple[CardFacts, HealthBoard]:
    hardware = HealthBoard(g.uuid for g in GPUS)
    plan = plan_gpus(GPUS, "none")
    replicas = {"GPU-2::1": "GPU-2", "GPU-2::2": "GPU-2"}
    made = CardFacts(GPUS, {"GPU-0"}, plan, hardware, HealthBoard([]), lambda: records,
                     "example.com", replicas)  # fmt: skip
    return made, hardware


def test_before_the_records_nobody_holds_anything() -> None:
    made, _ = facts(None)
    extras = made.extras()
    assert extras.holds == ()
    assert [(c.uuid, c.held_by) for c in extras.whole] == [("GPU-1", ""), ("GPU-2", "")]


def test_whole_holders_replicas_and_own_health_are_read_at_call_time() -> None:
    exclusive = {
        WHOLE: {"GPU-1": Holder("ns", "train", "main")},
        SLICED: {"GPU-2::1": Holder("ns", "a", "c"), "GPU-2::2": Holder("ns", "b", "c")},
    }
    records = Snapshot(taken_at=0.0, exclusive=exclusive)
    made, hardware = facts(records)
    extras = made.extras()
    assert [(h.device, h.card, h.holder) for h in extras.holds] == [
        ("GPU-1", "GPU-1", "ns/train/main"),
        ("GPU-2::1", "GPU-2", "ns/a/c"),
        ("GPU-2::2", "GPU-2", "ns/b/c"),
    ]
    held, sliced = extras.whole
    assert held.held_by == "ns/train/main"
    assert (sliced.replicas, sliced.replicas_held, sliced.held_by) == (2, 2, "ns/a/c, ns/b/c")
    assert extras.hardware_healthy == {"GPU-0": True}
    hardware.set("GPU-0", False, "XID 79")
    hardware.set("GPU-1", False, "XID 79")
    later = made.extras()
    assert later.hardware_healthy == {"GPU-0": False} and not later.whole[0].healthy


def test_without_mig_devices_no_mig_resource_is_named() -> None:
    assert mig_resource_names(plan_gpus(GPUS, "none"), "example.com") == {}
    made, _ = facts(None)
    assert made.exclusive_resource_names() == []
