"""The Prometheus endpoint and /healthz."""

from __future__ import annotations

import json
import platform
import socket
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from conftest import TESLA_P4, Node, cards, gpu_uuid
from kit.procs import free_port, poll, scrape
from prometheus_client.parser import text_string_to_metric_families

from gpushare import __version__
from gpushare.base.startup import StartupError
from gpushare.daemon import Daemon
from gpushare.ops.daemonmetrics import LinkState, MetricsServer, liveness, render_not_ready
from gpushare.sim.kubeletdouble import AdmissionError


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


MIB = 1 << 20


def per_card(text: str) -> dict[str, dict[str, float]]:
    """metric name -> gpu UUID -> value, for the per-card series."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "gpu" in sample.labels and "pod" not in sample.labels:
                found.setdefault(sample.name, {})[sample.labels["gpu"]] = sample.value
    return found


def test_metrics_report_cards_allocations_and_latency(node: Node) -> None:
    port = free_port()
    gpus = cards(TESLA_P4, 2)
    node.start(gpus, metrics_port=port, metrics_address="127.0.0.1")
    a = node.kubelet.admit("a", "main", {node.memory: 20, node.core: 30})
    node.kubelet.admit("b", "main", {node.memory: 20})
    with pytest.raises(AdmissionError):
        node.kubelet.admit("c", "main", {node.memory: 10})  # 9 + 9 free: spans two cards
    gpus[1 if a.card() == gpu_uuid(0) else 0]["xid"] = 79
    node.write_gpus(gpus)
    assert node.kubelet.wait_for(lambda k: k.healthy_count(node.memory) == 29, 30.0)

    status, text = scrape(port)
    assert status == 200
    got = samples(text)
    cards_seen = per_card(text)
    other = gpu_uuid(1) if a.card() == gpu_uuid(0) else gpu_uuid(0)
    for uuid in (gpu_uuid(0), gpu_uuid(1)):
        assert cards_seen["gpushare_memory_units_capacity"][uuid] == 29
        assert cards_seen["gpushare_memory_capacity_bytes"][uuid] == 29 * 256 * MIB
        assert cards_seen["gpushare_core_units_capacity"][uuid] == 100
    assert cards_seen["gpushare_memory_units_allocated"] == {a.card(): 20, other: 20}
    assert cards_seen["gpushare_memory_allocated_bytes"] == {
        a.card(): 20 * 256 * MIB,
        other: 20 * 256 * MIB,
    }
    assert cards_seen["gpushare_core_units_allocated"] == {a.card(): 30, other: 0}
    assert cards_seen["gpushare_gpu_healthy"] == {a.card(): 1, other: 0}
    index = {uuid: str(i) for i, uuid in enumerate((gpu_uuid(0), gpu_uuid(1)))}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpushare_enforcement_backend":  # per card and kind
                assert (sample.labels["kind"], sample.labels["backend"]) in (
                    ("memory", "interposer"),
                    ("compute", "interposer"),
                ) and sample.labels["index"] == index[sample.labels["gpu"]], sample
            elif "gpu" in sample.labels and "pod" not in sample.labels:
                uuid = sample.labels["gpu"]
                assert sample.labels == {
                    "gpu": uuid,
                    "index": index[uuid],
                    "model": TESLA_P4["name"],
                    "node": "",
                }, sample
            assert not sample.name.endswith("_created"), sample.name
    assert got[("gpushare_ready", ())] == 1
    memory = (("resource", node.memory),)
    assert got[("gpushare_allocations_total", (*memory, ("result", "ok")))] == 2
    assert got[("gpushare_allocations_total", (*memory, ("result", "precondition")))] == 1
    assert got[("gpushare_allocations_total", (("resource", node.core), ("result", "ok")))] == 1
    for method, calls in (("Allocate", 3), ("GetPreferredAllocation", 3)):
        key = ("gpushare_request_duration_seconds_count", (("method", method), *memory))
        assert got[key] == calls
    assert got[("gpushare_pod_resources_reads_total", (("result", "ok"),))] >= 1

    status, body = scrape(port, "/healthz")
    assert status == 200 and json.loads(body) == {"alive": True, "reason": "serving and registered"}
    status, body = scrape(port, "/readyz")
    assert status == 200 and json.loads(body) == {"ready": True, "reason": "serving and registered"}
    assert scrape(port, "/nothing")[0] == 404


def test_readyz_follows_registration_while_healthz_stays_alive(node: Node) -> None:
    port = free_port()
    node.start(cards(TESLA_P4, 1), metrics_port=port, metrics_address="127.0.0.1")
    # the kubelet lists the devices a moment before the daemon records its registration
    assert poll(lambda: scrape(port, "/readyz")[0] == 200, 30.0)
    node.kubelet.stop()  # kubelet.sock gone: the registration is lost
    assert poll(lambda: scrape(port, "/readyz")[0] == 503, 30.0)
    assert json.loads(scrape(port, "/readyz")[1]) == {
        "ready": False,
        "reason": "serving; not registered with the kubelet",
    }
    assert scrape(port, "/healthz")[0] == 200  # a restart of ours would not help
    node.kubelet.start()
    assert poll(lambda: scrape(port, "/readyz")[0] == 200, 30.0)


def test_healthz_does_not_flap_during_kubelet_restarts(node: Node) -> None:
    port = free_port()
    node.start(cards(TESLA_P4, 1), metrics_port=port, metrics_address="127.0.0.1")
    answers: list[int] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            answers.append(scrape(port, "/healthz")[0])

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        for _ in range(3):
            node.kubelet.restart()
            assert node.wait_registered(3.0)
        node.kubelet.stop()  # the kubelet down for a while: a restart of ours would not help
        assert node.kubelet.wait_for(lambda _k: len(answers) > 20, 0.5) or len(answers) > 0
    finally:
        done.set()
        prober.join()
    assert answers and set(answers) == {200}


def test_liveness_fails_only_where_a_restart_helps() -> None:
    def state(**changes: object) -> LinkState:
        base = {
            "serving": True,
            "registered": True,
            "unregistered_seconds": 0.0,
            "kubelet_present": True,
        }
        return LinkState(**{**base, **changes})  # type: ignore[arg-type]

    assert liveness(state())[0]
    assert liveness(state(registered=False, unregistered_seconds=5.0))[0]  # re-registering
    assert liveness(state(registered=False, unregistered_seconds=600, kubelet_present=False))[0]
    alive, why = liveness(state(registered=False, unregistered_seconds=61.0), 60.0)
    assert not alive and "registration has failed for 61 s" in why
    alive, why = liveness(state(serving=False))
    assert not alive and "not running" in why


def test_metrics_port_zero_serves_nothing(node: Node) -> None:
    daemon = node.start(cards(TESLA_P4, 1))  # the fixture's default: metrics_port=0
    assert daemon.metrics is None and daemon.metrics_part is None


def test_a_taken_metrics_port_stops_the_start_with_one_clear_line(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    node.kubelet.start()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = replace(node.settings, metrics_port=port, metrics_address="127.0.0.1")
        with pytest.raises(StartupError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            Daemon(settings).start()
    assert list(Path(settings.kubelet_dir).glob("gpushare-*.sock")) == []


def test_a_silent_connection_is_closed_and_the_server_keeps_answering() -> None:
    server = MetricsServer(
        lambda: b"ok\n", lambda: (True, "ok"), "127.0.0.1", 0, request_timeout=0.3
    )
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30.0) as silent:
            assert silent.recv(1) == b""  # closed by the server, not by our own timeout
        assert scrape(server.port, "/healthz") == (200, '{"alive": true, "reason": "ok"}\n')
    finally:
        server.stop()


def test_per_container_series_follow_the_kubelets_records(node: Node) -> None:
    port = free_port()
    node.start(cards(TESLA_P4, 2), metrics_port=port, metrics_address="127.0.0.1", node_name="")
    a = node.kubelet.admit("a", "main", {node.memory: 4, node.core: 30})
    b = node.kubelet.admit("b", "side", {node.core: 10})

    def containers() -> dict[tuple[str, str, str, str], float]:
        found = {}
        for family in text_string_to_metric_families(scrape(port)[1]):
            for sample in family.samples:
                if "pod" in sample.labels:
                    labels = sample.labels
                    assert set(labels) == {"namespace", "pod", "container", "gpu", "node"}
                    found[(sample.name, labels["pod"], labels["container"], labels["gpu"])] = (
                        sample.value
                    )
        return found

    expected = {
        ("gpushare_container_memory_bytes", "a", "main", a.card()): 4 * 256 * MIB,
        ("gpushare_container_core_units", "a", "main", a.card()): 30,
        ("gpushare_container_core_units", "b", "side", b.card()): 10,
    }
    assert poll(lambda: containers() == expected, 30.0), containers()
    node.kubelet.release("a")
    assert node.daemon is not None and node.daemon.core.refresher is not None
    node.daemon.core.refresher.poke()
    assert poll(
        lambda: set(containers()) == {("gpushare_container_core_units", "b", "side", b.card())},
        30.0,
    )


def test_gpushare_ready_and_registered_agree_with_readyz(node: Node) -> None:
    port = free_port()
    node.start(cards(TESLA_P4, 1), metrics_port=port, metrics_address="127.0.0.1")

    def state() -> tuple[int, float, dict[str, float]]:
        got = samples(scrape(port)[1])
        registered = {
            dict(labels)["resource"]: value
            for (name, labels), value in got.items()
            if name == "gpushare_registered"
        }
        return scrape(port, "/readyz")[0], got[("gpushare_ready", ())], registered

    # the kubelet lists the devices a moment before the daemon records its registration
    assert poll(lambda: state()[:2] == (200, 1), 30.0)
    status, ready, registered = state()
    assert (status, ready) == (200, 1)
    assert registered == {node.memory: 1, node.core: 1}
    node.kubelet.stop()  # registration lost: /readyz 503, and the metric says so too
    assert poll(lambda: state()[0] == 503, 30.0)
    status, ready, registered = state()
    assert ready == 0 and registered == {node.memory: 0, node.core: 0}
    node.kubelet.start()
    assert poll(lambda: state()[:2] == (200, 1), 30.0)


def test_build_info_names_the_version_and_nothing_is_created_noise(node: Node) -> None:
    port = free_port()
    node.start(cards(TESLA_P4, 1), metrics_port=port, metrics_address="127.0.0.1")
    text = scrape(port)[1]
    info = [
        sample.labels
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gpushare_build_info"
    ]
    assert info == [
        {"version": __version__, "python": platform.python_version(), "grpc": grpc.__version__}
    ]
    assert "_created" not in text
    assert "gpushare_build_info" in render_not_ready().decode()
