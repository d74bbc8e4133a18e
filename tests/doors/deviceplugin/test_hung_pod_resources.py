"""A kubelet whose PodResources endpoint takes calls and never answers (issue 41.7).

The binder waits up to ``RECORDS_WAIT`` (5 s) for the kubelet's records, which is right
for an endpoint that answers slowly; an endpoint that never answers cost every
container that wait per resource (5.0, 8.2, 10, 10, 10 ... s for eight admissions in a
row). Now one read that runs out of time is waited for, and the admissions after it
decide at once from what the daemon has, until a read is answered again. Measured by
counting the waits (the stand-in never answers, so a wait that happens runs out), never
by the clock.
"""

from __future__ import annotations

import time

from conftest import TESLA_P4, Node, cards
from kit.procs import eventually

#: the one wait that finds out, kept short; the default's 5 s changes nothing counted here
WAIT = 1.0


def test_a_hung_pod_resources_endpoint_is_waited_for_once_until_it_answers(
    node: Node,
) -> None:
    node.with_pod_specs()
    daemon = node.start(cards(TESLA_P4, 2))
    assert daemon.plugin is not None and daemon.core is not None
    daemon.plugin.binder.records_wait = WAIT
    records = daemon.core.pod_resources
    need = {node.memory: 4, node.core: 20}
    node.kubelet.hang_lists(True)

    def admit(name: str, i: int) -> None:
        node.pod(name, need)
        order = [node.core, node.memory] if i % 2 else [node.memory, node.core]
        admitted = node.kubelet.admit(name, "main", need, order=order)
        cards_held = {d.rpartition("::")[0] for ids in admitted.devices.values() for d in ids}
        assert cards_held == {admitted.card()}  # never split, records or not

    for i in range(8):
        admit(f"hung-{i}", i)
    # One caller waited and ran out; every read the other admissions asked for was
    # answered at once (each admission reads at least once per resource).
    assert records.waits_run_out == 1
    assert records.waits_skipped >= 2 * 8 - 1
    assert records.unanswered

    # The kubelet answers again: the next read that is tried (in the background, since
    # nobody waits) is answered, and admissions wait for the records again.
    node.kubelet.hang_lists(False)
    eventually(lambda: records.read_after(time.monotonic(), timeout=WAIT) is not None)
    assert not records.unanswered
    skipped = records.waits_skipped
    served = node.kubelet.lists_served
    admit("answered", 0)
    assert records.waits_skipped == skipped
    assert node.kubelet.lists_served > served  # the admission read fresh records
    assert records.waits_run_out == 1
