"""Every listener the project ships bounds what strangers can make it hold:
connections and threads are capped overall and per client address, a
connection beyond the caps is answered 503 at once, and a request must be complete and
answered within a total deadline however slowly its bytes trickle in.

Clients here are real TCP connections on loopback (127.0.0.x gives distinct client
addresses). The measurement under 5 000 slow connections against the daemon's own
process is ``test_rss_under_5000_slow_metrics_connections`` (marker ``slow``).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import TESLA_P4, Node, cards
from kit.procs import daemon_command, free_port, poll, scrape

from gpushare.base.connguard import ConnectionGuard, ConnectionLimits
from gpushare.extender.httpserver import ExtenderSettings, build_app, start
from gpushare.ops.daemonmetrics import MetricsServer


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (bounded by the socket timeout)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _get(port: int, path: str = "/healthz", source: str = "127.0.0.1") -> bytes:
    with _connect(port, source) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return _answer(sock)


# The caps are checked with a deadline no loaded machine reaches (the silent connections
# must still be held when the seventh arrives); the deadline itself with a short one.
PATIENT = 600.0
SHORT = 1.0


def _metrics_server(deadline: float) -> Iterator[MetricsServer]:
    server = MetricsServer(
        lambda: b"# metrics\n",
        lambda: (True, "ok"),
        "127.0.0.1",
        0,
        limits=ConnectionLimits(max_connections=6, max_per_peer=3, deadline=deadline),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def metrics() -> Iterator[MetricsServer]:
    yield from _metrics_server(SHORT)


@pytest.fixture
def patient_metrics() -> Iterator[MetricsServer]:
    yield from _metrics_server(PATIENT)


def test_the_metrics_listener_caps_connections_per_client_and_overall(
    patient_metrics: MetricsServer,
) -> None:
    metrics = patient_metrics
    slow = [_connect(metrics.port) for _ in range(3)]  # hold three slots, send nothing
    try:
        assert poll(lambda: metrics.guard.active == 3, 30)
        # A fourth from the same address: refused at once, without a thread...
        refused = _get(metrics.port, "/metrics")
        assert refused.startswith(b"HTTP/1.1 503"), refused
        assert b"too many connections" in refused
        # ... but a probe is still answered (from the accepting thread): slow strangers
        # holding every slot cannot fail the liveness probe and get the daemon restarted.
        assert _get(metrics.port, "/healthz").startswith(b"HTTP/1.1 200")
        # Another client still gets its metrics.
        assert b"# metrics" in _get(metrics.port, "/metrics", source="127.0.0.2")
        more = [_connect(metrics.port, f"127.0.0.{i}") for i in (3, 4, 5)]
        try:
            assert poll(lambda: metrics.guard.active == 6, 30)
            full = _get(metrics.port, "/metrics", source="127.0.0.9")
            assert full.startswith(b"HTTP/1.1 503"), full
            assert _get(metrics.port, "/readyz", source="127.0.0.9").startswith(b"HTTP/1.1 200")
        finally:
            for sock in more:
                sock.close()
    finally:
        for sock in slow:
            sock.close()
    assert poll(lambda: metrics.guard.active == 0, 30)
    assert b"# metrics" in _get(metrics.port, "/metrics")


def test_a_request_trickled_byte_by_byte_is_cut_at_the_deadline(metrics: MetricsServer) -> None:
    sock = _connect(metrics.port)
    request = b"GET /metrics HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 10_000
    closed = threading.Event()

    def trickle() -> None:
        try:
            for byte in request:  # a byte every 50 ms: each read is quick, the whole is not
                sock.send(bytes([byte]))
                if closed.wait(0.05):
                    return
        except OSError:
            closed.set()

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        assert poll(closed.is_set, 60), "the slow request was never cut"
        assert metrics.guard.expired >= 1
    finally:
        closed.set()
        sender.join()
        sock.close()
    assert poll(lambda: metrics.guard.active == 0, 30)


# -- the extender's listeners (aiohttp) ----------------------------------------------


def test_the_extender_listeners_cap_connections_and_cut_slow_requests() -> None:
    async def scenario() -> None:
        settings = ExtenderSettings(api_server="http://127.0.0.1:9")

        async def hold_two(port: int, guard: ConnectionGuard) -> list[Any]:
            slow = [
                await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.1", 0))
                for _ in range(2)
            ]
            deadline = time.monotonic() + 10
            while guard.active < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return slow

        # The caps, with a deadline no loaded machine reaches while they are checked.
        limits = ConnectionLimits(max_connections=4, max_per_peer=2, deadline=PATIENT)
        guard = ConnectionGuard(limits)
        runner, port = await start(build_app(settings), "127.0.0.1", 0, guard=guard)
        try:
            slow = await hold_two(port, guard)
            assert guard.active == 2
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            refused = await reader.read()
            assert refused.startswith(b"HTTP/1.1 503"), refused
            writer.close()
            # Another address is served, and a kept-alive client keeps its connection.
            conn = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=conn) as session:
                for _ in range(3):
                    async with session.get(f"http://127.0.0.1:{port}/healthz") as reply:
                        assert reply.status == 200
            assert guard.expired == 0
            for _, w in slow:
                w.close()
        finally:
            await runner.cleanup()
        # The deadline: two silent connections are cut.
        guard = ConnectionGuard(ConnectionLimits(max_connections=4, max_per_peer=2, deadline=SHORT))
        runner, port = await start(build_app(settings), "127.0.0.1", 0, guard=guard)
        try:
            for r, w in await hold_two(port, guard):
                assert await asyncio.wait_for(r.read(), 60) == b""
                w.close()
            assert guard.expired >= 2
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


# -- the measurement ---------------------------------------------------------------------


def _status(pid: int) -> tuple[int, int, int]:
    """VmRSS and VmHWM (KiB) and the thread count of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = [
        int(re.search(rf"{key}:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
        for key in ("VmRSS", "VmHWM", "Threads")
    ]
    return found[0], found[1], found[2]


@pytest.mark.slow
def test_rss_under_5000_slow_metrics_connections(
    short_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = Node(short_tmp)
    node.write_gpus(cards(TESLA_P4, 2))
    node.kubelet.start()
    port = free_port()
    daemon = subprocess.Popen(
        daemon_command(node, port=port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    held: list[socket.socket] = []
    try:
        assert poll(lambda: _reachable(port), 60)
        before = _status(daemon.pid)
        refused = 0
        for i in range(5000):  # from 250 client addresses, 20 each
            source = f"127.0.1.{1 + (i // 20) % 250}"
            sock = socket.create_connection(
                ("127.0.0.1", port), timeout=10, source_address=(source, 0)
            )
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")  # and never more
            held.append(sock)
        during = _status(daemon.pid)
        for sock in held:
            sock.setblocking(False)
            try:
                if sock.recv(64).startswith(b"HTTP/1.1 503"):
                    refused += 1
            except (BlockingIOError, ConnectionResetError):
                pass
        after_probe = scrape(port, "/healthz")[0]
        with capsys.disabled():
            print(
                f"\nmetrics listener, 5000 slow connections: RSS {before[0] / 1024:.1f} -> "
                f"{during[0] / 1024:.1f} MiB (peak {during[1] / 1024:.1f} MiB), threads "
                f"{before[2]} -> {during[2]}, refused at once {refused}, /healthz {after_probe}"
            )
        assert during[1] < 128 * 1024
    finally:
        for sock in held:
            sock.close()
        daemon.terminate()
        daemon.wait(timeout=30)
        node.kubelet.stop()


def _reachable(port: int) -> bool:
    try:
        return scrape(port, "/healthz")[0] == 200
    except OSError:
        return False


# -- the second wall: NetworkPolicy ------------------------------------------------------


def test_the_manifests_let_only_the_monitoring_namespace_reach_the_metrics_port() -> None:
    import yaml
    from test_deploy_manifests import ROOT, chart_objects

    daemonset = yaml.safe_load((ROOT / "daemonset" / "daemonset.yaml").read_text())
    pod = daemonset["spec"]["template"]
    (policy,) = yaml.safe_load_all((ROOT / "daemonset" / "networkpolicy.yaml").read_text())
    assert policy["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert [p["port"] for p in rule["ports"]] == ["metrics"] and "metrics" in ports
    kustomization = yaml.safe_load((ROOT / "daemonset" / "kustomization.yaml").read_text())
    assert "networkpolicy.yaml" in kustomization["resources"]

    def rendered(values: dict[str, object] | None = None) -> list[dict[str, object]]:
        return [o for o in chart_objects(values) if o["kind"] == "NetworkPolicy"]

    (chart,) = rendered()
    (chart_rule,) = chart["spec"]["ingress"]  # type: ignore[index]
    assert chart_rule["from"] == rule["from"] and chart_rule["ports"] == [
        {"protocol": "TCP", "port": 9445}
    ]
    scrapers = [{"namespaceSelector": {"matchLabels": {"team": "observability"}}}]
    (custom,) = rendered({"networkPolicy": {"metricsFrom": scrapers}})
    assert custom["spec"]["ingress"][0]["from"] == scrapers  # type: ignore[index]
    assert not rendered({"networkPolicy": {"enabled": False}})


def test_an_extender_client_that_does_not_read_its_answer_is_cut_at_the_deadline() -> None:
    """The deadline covers writing the answer: a client that posts a filter whose answer
    is large (the nodes it sent, echoed) and never reads it used to hold its connection
    and the buffered answer for ever (the timer stopped when the answer was prepared)."""

    async def scenario() -> None:
        limits = ConnectionLimits(max_connections=4, max_per_peer=2, deadline=3.0)
        settings = ExtenderSettings(api_server="http://127.0.0.1:9", max_body_bytes=64 << 20)
        guard = ConnectionGuard(limits)
        runner, port = await start(build_app(settings), "127.0.0.1", 0, guard=guard)
        try:
            nodes = [{"metadata": {"name": f"n{i}", "labels": {"x": "y" * 4000}}}
                     for i in range(2500)]  # fmt: skip
            body = json.dumps(
                {"Pod": {"metadata": {"name": "p", "namespace": "d"}, "spec": {}},
                 "Nodes": {"items": nodes}}
            ).encode()  # fmt: skip
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            head = (
                f"POST /gpushare/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            await asyncio.get_running_loop().sock_sendall(sock, head + body)
            try:
                deadline = time.monotonic() + 30
                while guard.active and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert guard.active == 0, "a client that reads nothing still holds its answer"
                assert guard.expired >= 1
            finally:
                sock.close()
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
