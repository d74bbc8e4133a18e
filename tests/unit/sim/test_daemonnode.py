"""gpushare.sim.daemonnode: the simulation's node (the daemon in-process with a kubelet stand-in
and its own pod specs): a pod's containers land on one card and the rooms say what is
left there, a pod no card can hold is an admission failure recorded by name, and a
released pod gives its units back."""

from __future__ import annotations

from gpushare.extender.fit import ContainerNeed, PodNeed
from gpushare.sim.daemonnode import DaemonNode

CARDS = [("GPU-a", "Tesla T4", 4096), ("GPU-b", "Tesla T4", 4096)]  # 16 units each


def test_admit_rooms_refusal_and_release() -> None:
    node = DaemonNode("sim-1", CARDS, "binpack", seed=3)
    node.start()
    try:
        pair = PodNeed((ContainerNeed("a", 4, 30), ContainerNeed("b", 2, 20)))
        use = node.admit("p1", pair)
        assert use is not None and sum(m for m, _c in use.values()) == 6
        assert sum(c for _m, c in use.values()) == 50
        rooms = {room.uuid: room for room in node.rooms()}
        for uuid, (memory, core) in use.items():
            assert rooms[uuid].memory_free == 16 - memory and rooms[uuid].core_free == 100 - core
        assert node.admit("huge", PodNeed((ContainerNeed("x", 17, 0),))) is None
        assert len(node.failures) == 1 and node.failures[0].startswith("sim-1/huge: ")
        node.release("p1")
        assert all(r.memory_free == 16 and r.core_free == 100 for r in node.rooms())
    finally:
        node.stop()
    assert not node.root.exists()
