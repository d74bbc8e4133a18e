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

import threading
import time
from pathlib import Path

from conftest import TESLA_P4, Node, cards
from kit.procs import eventually

from gpushare.node.podresources import LIST_TIMEOUT, PodResourcesClient
from gpushare.share.records import Snapshot

#: the one wait that finds out, kept short; the default's 5 s changes nothing counted here.
#: Not shorter than the usage refresher's own reads (LIST_TIMEOUT): a read that ran out
#: makes only callers of its patience or less skip, and the refresher must be one of them.
WAIT = LIST_TIMEOUT


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


def test_a_short_read_running_out_does_not_make_a_patient_caller_skip(node: Node) -> None:
    """The usage refresher's read (2 s) ran out on a kubelet busy for longer; an
    admission arriving then (5 s, ``RECORDS_WAIT``) still waits for the records with its
    own patience and gets them, instead of deciding without them (``make bench`` refused
    2 admissions of 5 000 that way: "memory bound to GPU5, core on GPU7"). A read is
    never proof that a more patient caller would not be answered."""
    node.start(cards(TESLA_P4, 2))
    client = PodResourcesClient(Path(node.settings.pod_resources_socket), {})
    try:
        node.kubelet.hang_lists(True)
        assert client.list(timeout=0.2) is None  # the short read runs out
        assert client.unanswered and client.unanswered_after == 0.2
        asked = time.monotonic()
        got: list[Snapshot | None] = []
        patient = threading.Thread(target=lambda: got.append(client.read_after(asked, timeout=60)))
        patient.start()
        # its own read is under way (or, as before this fix, it was answered None at once)
        eventually(lambda: not patient.is_alive() or (client._inflight or 0.0) >= asked)
        node.kubelet.hang_lists(False)
        patient.join()
        assert got and got[0] is not None, client.last_error
        assert got[0].taken_at >= asked
        assert client.waits_skipped == 0 and not client.unanswered
    finally:
        node.kubelet.hang_lists(False)
        client.close()
