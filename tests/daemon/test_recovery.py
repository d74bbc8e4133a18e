"""Recovery from the kubelet's records, restarts of both sides, and failing sources."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CARD_4GIB, TESLA_P4, Node, cards, gpu_uuid
from kit.procs import daemon_process, free_port, poll, reachable, scrape
from prometheus_client.parser import text_string_to_metric_families
from test_exclusion import card_of

from gpushare.daemon import Daemon
from gpushare.deviceplugin.registration import UNWATCHED_GRACE
from gpushare.gpu.gpus import Gpu, GpuError, GpuEvent
from gpushare.gpu.simulated import SimulatedBackend
from gpushare.share.devices import Resource


def per_card_metrics(text: str) -> dict[str, dict[str, float]]:
    """metric name -> gpu -> value, for the per-card gauges."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "gpu" in sample.labels:
                found.setdefault(sample.name, {})[sample.labels["gpu"]] = sample.value
    return found


def kubelet_per_card(node: Node, resource: str) -> dict[str, float]:
    used = {gpu_uuid(0): 0.0, gpu_uuid(1): 0.0}
    for device_id in node.kubelet.allocated(resource):
        used[device_id.split("::")[0]] += 1
    return used


def test_kill_9_and_restart_agrees_with_the_kubelet_and_respects_its_records(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 2))
    node.kubelet.start()
    port = free_port()
    first = daemon_process(node, port)
    second = None
    try:
        assert node.wait_registered(10.0)
        a = node.kubelet.admit("a", "main", {node.memory: 10, node.core: 90})
        b = node.kubelet.admit("b", "main", {node.memory: 20})
        card_a, card_b = a.card(), b.card()
        assert card_a != card_b  # spread
        registrations = len(node.kubelet.registrations)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        # the kubelet notices the stream is gone and marks the devices unhealthy
        assert node.kubelet.wait_for(lambda k: k.healthy_count(node.memory) == 0, 30.0)

        second = daemon_process(node, port)
        assert node.kubelet.wait_for(
            lambda k: (
                len(k.registrations) >= registrations + 2
                and k.healthy_count(node.memory) == 58
                and k.healthy_count(node.core) == 200
            ),
            10.0,
        )
        assert poll(lambda: reachable(port), 30.0)
        # at once: no Allocate has happened since the restart, the records are the source
        reported = per_card_metrics(scrape(port)[1])
        assert reported["gpushare_memory_units_allocated"] == kubelet_per_card(node, node.memory)
        assert reported["gpushare_core_units_allocated"] == kubelet_per_card(node, node.core)
        assert reported["gpushare_memory_units_allocated"] == {card_a: 10, card_b: 20}
        assert reported["gpushare_core_units_allocated"] == {card_a: 90, card_b: 0}

        # Memory first, spread: card A has more free memory, but only card B has the
        # 20 core units that follow. Only the recovered core usage can tell.
        c = node.kubelet.admit(
            "c", "main", {node.memory: 5, node.core: 20}, order=[node.memory, node.core]
        )
        assert c.card() == card_b
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)


def test_a_missing_pod_resources_socket_is_retried_and_caught_up_with(node: Node) -> None:
    real = node.kubelet.pod_resources_socket
    assert real is not None
    late = real.parent.parent / "pr-late" / "kubelet.sock"
    node.start(
        cards(TESLA_P4, 2), pod_resources_socket=str(late), pod_resources_interval_seconds=0.2
    )
    daemon = node.daemon
    assert daemon is not None and daemon.core is not None
    refresher, usage = daemon.core.refresher, daemon.core.usage
    node.kubelet.admit("a", "main", {node.memory: 3})
    node.kubelet.admit("b", "main", {node.memory: 4})
    assert poll(lambda: refresher.failures >= 2, 30.0)  # retried, and still serving
    node.kubelet.release("a")  # only the kubelet knows: no Allocate tells the daemon
    wanted = {uuid: int(n) for uuid, n in kubelet_per_card(node, node.memory).items()}
    assert usage.used_counts(Resource.MEMORY) != wanted
    late.parent.mkdir(parents=True)
    late.symlink_to(real)  # the kubelet's socket appears
    assert poll(lambda: usage.used_counts(Resource.MEMORY) == wanted, 30.0)


@pytest.mark.parametrize("restarts", [8, pytest.param(20, marks=pytest.mark.slow)], ids=["8", "20"])
def test_kubelet_restart_loops_end_registered_with_both_resources(
    node: Node, restarts: int
) -> None:
    """make test restarts the kubelet 8 times (two of them twice in a row, the second
    right after the plugin registered); the 20 run under ``slow``."""
    node.start(cards(TESLA_P4, 2))
    for i in range(restarts):
        count = len(node.kubelet.registrations)
        node.kubelet.restart()
        if i % 3 == 1:
            # re-created again right after the plugin registered (within milliseconds)
            assert node.kubelet.wait_for(lambda k, c=count: len(k.registrations) > c, 30.0)
            node.kubelet.restart()
        assert node.kubelet.wait_for(
            lambda k: k.healthy_count(node.memory) == 58 and k.healthy_count(node.core) == 200,
            30.0,
        ), f"not registered after restart {i}"
    # The counts can come from an endpoint the last restart orphaned: a second restart
    # right after a registration deletes the socket just offered, which the daemon sees
    # and offers again. Admit once the daemon is registered with the kubelet now in place.
    assert node.daemon is not None and node.daemon.plugin.link is not None
    assert poll(node.daemon.plugin.link.registered_with_current, 30.0)
    assert node.kubelet.admit("p", "main", {node.memory: 2, node.core: 10}).card()


def test_a_kubelet_back_from_a_long_outage_gets_one_registration_not_two(node: Node) -> None:
    node.start(cards(TESLA_P4, 1))
    node.kubelet.stop(keep_pod_resources=True)
    node.kubelet.socket.unlink(missing_ok=True)
    time.sleep(UNWATCHED_GRACE + 0.5)  # the outage: longer than a closed stream's grace
    node.kubelet.watch_delay = 0.5  # and the kubelet back is slow to dial the plugins
    count = len(node.kubelet.registrations)
    node.kubelet.start()
    assert node.kubelet.wait_for(
        lambda k: k.healthy_count(node.memory) == 29 and k.healthy_count(node.core) == 100, 30.0
    )
    # The streams that closed with the outage must not count against the new kubelet.
    assert len(node.kubelet.registrations) == count + 2, node.kubelet.registrations[count:]


def test_a_kubelet_slow_to_watch_is_never_offered_the_same_socket_twice(node: Node) -> None:
    """A kubelet that opens no stream within the grace after a registration gets a second
    one; but it still holds the first path's endpoint, and a 1.37 kubelet refuses that
    path again for as long as it runs ("device plugin already connected"; the stand-in
    refuses it the same way). The second offer must come on a fresh socket name."""
    node.start(cards(TESLA_P4, 1))
    daemon = node.daemon
    assert daemon is not None and daemon.plugin.link is not None
    link = daemon.plugin.link
    node.kubelet.watch_delay = UNWATCHED_GRACE + 1.0  # dials back after the grace
    count = len(node.kubelet.registrations)
    node.kubelet.restart()
    assert node.kubelet.wait_for(
        lambda k: k.healthy_count(node.memory) == 29 and k.healthy_count(node.core) == 100,
        60.0,
    )
    assert poll(lambda: link.registered.is_set(), 30.0)
    assert link.unwatched_retries >= 1  # the grace ran out: the path this test is about
    assert node.kubelet.refused == []
    later = node.kubelet.registrations[count:]
    assert len(later) == len(set(later)), later  # no path offered twice to this kubelet
    # one socket of ours per resource is left: each renewal removed the one before
    ours = sorted(p.name for p in Path(node.settings.kubelet_dir).glob("gpushare-*.sock"))
    assert len(ours) == 2, ours
    assert node.kubelet.admit("p", "main", {node.memory: 2, node.core: 10}).card()
    # a new kubelet gets the instance's first names again
    assert node.daemon is not None
    firsts = {server.base_path.name for server in node.daemon.plugin.servers}
    token = node.daemon.plugin.token
    assert firsts == {f"gpushare-vcuda-memory.{token}.sock", f"gpushare-vcuda-core.{token}.sock"}
    node.kubelet.watch_delay = 0.0
    count = len(node.kubelet.registrations)
    node.kubelet.restart()
    assert node.kubelet.wait_for(
        lambda k: {e for _r, e in k.registrations[count:]} >= firsts, 30.0
    ), node.kubelet.registrations[count:]
    assert node.kubelet.wait_for(lambda k: k.healthy_count(node.memory) == 29, 30.0)


class FlakyNvml:
    """A simulated node whose GPU listing fails the first ``failures`` times, as NVML
    can after a driver hiccup while its initialisation succeeded."""

    def __init__(self, path: Path, failures: int) -> None:
        self.simulated = SimulatedBackend(path)
        self.failures = failures
        self.calls = 0

    def discover(self) -> list[Gpu]:
        self.calls += 1
        if self.calls <= self.failures:
            raise GpuError("NVML failed while counting GPUs: Unknown Error")
        return self.simulated.discover()

    def watch(self, deliver: Callable[[GpuEvent], None], stop: threading.Event) -> None:
        self.simulated.watch(deliver, stop)

    def close(self) -> None:
        self.simulated.close()


def test_gpus_unreadable_at_start_are_retried_not_a_crash(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    node.kubelet.start()
    backend = FlakyNvml(node.gpus_file, failures=1)
    node.daemon = Daemon(node.settings, backend=backend)
    node.daemon.start()
    assert backend.calls == 2
    assert node.wait_registered()


@pytest.mark.parametrize("binpack", [True, False])
def test_a_pod_unlisted_after_a_kubelet_restart_still_fills_its_card(
    node: Node, binpack: bool
) -> None:
    """Found by the e2e suite (test_registration's held-before/held-after): a restarted
    kubelet admits the pods of its first batch in creation order, to the second, and
    lists in PodResources only the pods admitted so far. A pod created in the same second
    as a running one can come first: the running pod's units are held but unlisted. The
    card it fills must not look empty of the resource asked second."""
    node.with_pod_specs()
    node.start(cards(CARD_4GIB, 2), placement="binpack" if binpack else "spread")
    limits = {node.memory: 12, node.core: 50}
    node.pod("held-before", limits)
    first = node.kubelet.admit("held-before", "main", limits, order=[node.core, node.memory])
    count = len(node.kubelet.registrations)
    node.kubelet.restart(empty_pod_manager=True)
    assert node.kubelet.wait_for(lambda k: len(k.registrations) >= count + 2, 30.0)
    assert node.daemon is not None and node.daemon.plugin.link is not None
    assert poll(node.daemon.plugin.link.registered_with_current, 30.0)
    assert node.kubelet.wait_for(
        lambda k: k.healthy_count(node.memory) == 32 and k.healthy_count(node.core) == 200, 30.0
    )
    node.pod("held-after", limits)
    second = node.kubelet.admit("held-after", "main", limits, order=[node.core, node.memory])
    assert second.card() != first.card()
    assert {card_of(d) for ids in second.devices.values() for d in ids} == {second.card()}
    node.kubelet.pods_synced()


def test_a_memory_only_pod_unlisted_after_a_kubelet_restart_keeps_its_card_full(
    node: Node,
) -> None:
    """Issue 32.14 (a): a running pod asking memory units only, not listed yet by the
    restarted kubelet, holds memory but no core on its card: the core offer shows nothing
    unlisted there. A container whose cores are asked first must not be bound to that
    card (its memory would be refused there): the daemon remembers who held units before
    the restart until the records list them again."""
    node.with_pod_specs()
    node.start(cards(CARD_4GIB, 2), placement="binpack")
    memory_only = {node.memory: 12}
    node.pod("held-before", memory_only)
    first = node.kubelet.admit("held-before", "main", memory_only)
    assert node.daemon is not None
    assert node.daemon.core.refresher.refresh_once()  # it ran a while: the records list it
    count = len(node.kubelet.registrations)
    node.kubelet.restart(empty_pod_manager=True)
    assert node.kubelet.wait_for(lambda k: len(k.registrations) >= count + 2, 30.0)
    assert node.daemon is not None and node.daemon.plugin.link is not None
    assert poll(node.daemon.plugin.link.registered_with_current, 30.0)
    assert node.kubelet.wait_for(
        lambda k: k.healthy_count(node.memory) == 32 and k.healthy_count(node.core) == 200, 30.0
    )
    both = {node.memory: 8, node.core: 50}
    node.pod("after", both)
    second = node.kubelet.admit("after", "main", both, order=[node.core, node.memory])
    assert second.card() != first.card()
    assert {card_of(d) for ids in second.devices.values() for d in ids} == {second.card()}
    node.kubelet.pods_synced()


@pytest.mark.parametrize("placement", ["binpack", "spread"])
@pytest.mark.parametrize("restarted", [False, True], ids=["steady", "kubelet-restarted"])
def test_pods_ending_during_an_admission_leave_their_card_to_it(
    node: Node, restarted: bool, placement: str
) -> None:
    """Issue 32.14 (a), as the e2e churn test saw it on a real kubelet v1.36.3 after a
    restart: three Tesla P4 of 29 units, three pods of 9 units and 10 cores on each;
    the pods of GPU2 are being deleted and their termination completes while the kubelet
    admits a fourth such pod, cores first. The core offer still counts their cores; the
    daemon's own ``List`` (which runs the kubelet's ``UpdateAllocatedDevices``) frees
    them, so the records list nobody there: GPU2's memory looked "held by someone
    unlisted", every card full, and the cores went to GPU0 by the policy, where the
    memory was then refused ("no single card holds both requests"). Two faults: the
    holders listed before the restart were counted on top of the fresh records that list
    them again, and a card whose room the records cannot tell was ranked with cards
    known to be full. It is tried first now, and a pod being deleted holds nothing."""
    specs = node.with_pod_specs()
    node.start(cards(TESLA_P4, 3), placement=placement)
    limits = {node.memory: 9, node.core: 10}
    pods: dict[str, dict[str, object]] = {}
    for i in range(9):
        pods[f"p{i}"] = node.pod(f"p{i}", limits)
        node.kubelet.admit(f"p{i}", "main", limits)
        specs.update(pods[f"p{i}"] | {"status": {"phase": "Running"}})
    by_card: dict[str, list[str]] = {}
    for (_ns, pod, _c), record in node.kubelet.admitted.items():
        by_card.setdefault(record.card(), []).append(pod)
    assert sorted(len(v) for v in by_card.values()) == [3, 3, 3]
    assert node.daemon is not None
    assert node.daemon.core.refresher.refresh_once()  # the records list all nine
    if restarted:
        count = len(node.kubelet.registrations)
        node.kubelet.restart()
        assert node.kubelet.wait_for(lambda k: len(k.registrations) >= count + 2, 30.0)
        link = node.daemon.plugin.link
        assert link is not None
        # registered with the new kubelet, not only with the socket it replaced: a
        # registration still to come would move the daemon's sockets once more
        assert poll(link.registered_with_current, 30.0)
        assert node.kubelet.wait_for(
            lambda k: k.healthy_count(node.memory) == 87 and k.healthy_count(node.core) == 300,
            30.0,
        )
    ending = by_card[gpu_uuid(2)]
    for name in ending:
        deleting = dict(pods[name])
        meta = dict(pods[name]["metadata"])  # type: ignore[call-overload]
        deleting["metadata"] = meta | {"deletionTimestamp": "2026-11-27T11:13:16Z"}
        specs.update(deleting | {"status": {"phase": "Running"}})
        node.kubelet.end(name)
    node.pod("late", limits)
    record = node.kubelet.admit("late", "main", limits, order=[node.core, node.memory])
    assert record.card() == gpu_uuid(2)
    assert {card_of(d) for ids in record.devices.values() for d in ids} == {gpu_uuid(2)}


def test_the_restart_is_cleared_once_the_kubelet_lists_everyone_with_no_allocate_to_prompt(
    node: Node,
) -> None:
    """Issue 32.14 (b): while the daemon publishes a kubelet restart the extender sends
    no pod to the node, so no Allocate prompts a read of the records: the daemon read
    them only at its interval (30 s by default), and the e2e churn test saw a pod wait
    31 s after a restart. It now reads every second until the records are complete."""
    node.with_pod_specs()
    node.start(cards(CARD_4GIB, 2), pod_resources_interval_seconds=3600.0)
    limits = {node.memory: 4, node.core: 10}
    node.pod("running", limits)
    node.kubelet.admit("running", "main", limits)
    assert node.daemon is not None
    core = node.daemon.core
    assert core.refresher.refresh_once()
    count = len(node.kubelet.registrations)
    node.kubelet.restart(empty_pod_manager=True)
    assert node.kubelet.wait_for(lambda k: len(k.registrations) >= count + 2, 30.0)
    assert node.daemon is not None and node.daemon.plugin.link is not None
    assert poll(node.daemon.plugin.link.registered_with_current, 30.0)
    assert poll(lambda: core.restart.restarted_at() != "", 30.0)  # noticed, published
    reads = core.refresher.reads
    assert poll(lambda: core.refresher.reads >= reads + 2, 30.0)  # read again, unprompted
    assert core.restart.restarted_at() != ""  # the kubelet does not list the pod yet
    node.kubelet.pods_synced()  # its pod sources are ready: it lists the pod again
    assert poll(lambda: core.restart.restarted_at() == "", 60.0)
