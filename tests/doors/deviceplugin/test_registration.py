"""Registration, device lists and staying registered, against a kubelet stand-in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import RTX_3090, TESLA_P4, Node, cards, gpu_uuid, nvml_loads
from kit.procs import daemon_command, error_lines, free_port, poll, reachable, scrape


def test_both_resources_register_with_the_reference_device_counts(node: Node) -> None:
    node.start([*cards(RTX_3090, 1), {"uuid": gpu_uuid(9), **TESLA_P4}])
    registered = {resource: endpoint for resource, endpoint in node.kubelet.registrations}
    assert node.daemon is not None
    token = node.daemon.plugin.token  # each daemon instance names its sockets for itself
    assert registered == {
        "gpushare.io/vcuda-memory": f"gpushare-vcuda-memory.{token}.sock",
        "gpushare.io/vcuda-core": f"gpushare-vcuda-core.{token}.sock",
    }
    memory = node.kubelet.devices(node.memory)
    per_card = {
        u: sum(1 for d in memory if d.startswith(u + "::")) for u in (gpu_uuid(0), gpu_uuid(9))
    }
    assert per_card == {gpu_uuid(0): 94, gpu_uuid(9): 29}  # 24259 // 256, 7611 // 256
    assert len(node.kubelet.devices(node.core)) == 200
    assert all(d.health == "Healthy" for d in memory.values())
    first = memory[f"{gpu_uuid(0)}::0"]
    assert [n.ID for n in first.topology.nodes] == [0]
    assert not memory[f"{gpu_uuid(9)}::0"].HasField("topology")  # no numa_node given
    assert all(len(device_id) <= 63 for device_id in memory)


def test_device_ids_are_stable_across_restarts(node: Node) -> None:
    node.start(cards(TESLA_P4, 2))
    before = list(node.kubelet.devices(node.memory))
    assert node.daemon is not None
    node.daemon.stop()
    node.kubelet.restart()
    node.start(cards(TESLA_P4, 2))
    assert list(node.kubelet.devices(node.memory)) == before


def test_resource_prefix_and_unit_size_are_configurable(node: Node) -> None:
    node.start(cards(TESLA_P4, 1), resource_prefix="baidu.com", memory_unit_mib=1024)
    assert len(node.kubelet.devices("baidu.com/vcuda-memory")) == 7  # 7611 // 1024
    assert len(node.kubelet.devices("baidu.com/vcuda-core")) == 100


def test_reregisters_on_the_new_kubelet_socket_after_a_kubelet_restart(node: Node) -> None:
    """Each restart is answered because kubelet.sock changed, never by the fallback for
    a kubelet that stopped watching (which waits a grace period of seconds first)."""
    node.start(cards(TESLA_P4, 1))
    assert node.daemon is not None and node.daemon.plugin.link is not None
    link = node.daemon.plugin.link
    for _ in range(3):
        count = len(node.kubelet.registrations)
        node.kubelet.restart()  # deletes every socket, our two included
        assert node.kubelet.wait_for(lambda k, c=count: len(k.registrations) >= c + 2, 30.0)
        assert node.wait_registered(30.0)
    assert link.unwatched_retries == 0
    assert node.socket(node.memory).exists()
    assert node.kubelet.admit("p", "c", {node.memory: 2}).card() == gpu_uuid(0)


def test_reregisters_when_only_kubelet_sock_is_replaced(node: Node) -> None:
    """The new kubelet.sock alone (renamed over the old one, never missing) must be
    enough: a kubelet that fails to clean its directory leaves our sockets in place."""
    daemon = node.start(cards(TESLA_P4, 1))
    assert daemon.plugin.link is not None
    link = daemon.plugin.link
    count = len(node.kubelet.registrations)
    node.kubelet.restart(remove_sockets=False)
    assert node.kubelet.wait_for(lambda k: len(k.registrations) >= count + 2, 30.0)
    assert node.wait_registered(30.0)
    # Answered because kubelet.sock changed, not by the fallback for a closed stream (which
    # waits out a grace of 2 s first): asserted by the cause, not by a clock that a loaded
    # machine stretches.
    assert link.unwatched_retries == 0
    assert node.kubelet.admit("p", "c", {node.memory: 2}).card() == gpu_uuid(0)


def test_serves_again_when_its_own_socket_disappears(node: Node) -> None:
    node.start(cards(TESLA_P4, 1))
    count = len(node.kubelet.registrations)
    node.socket(node.core).unlink()
    assert node.kubelet.wait_for(
        lambda k: len(k.registrations) >= count + 2 and k.healthy_count(node.core) == 100, 30.0
    )
    assert node.kubelet.admit("p", "c", {node.core: 5}).envs["CUDA_DEVICE_SM_LIMIT"] == "5"


def test_a_socket_path_it_cannot_bind_is_retried_not_fatal(node: Node) -> None:
    daemon = node.start(cards(TESLA_P4, 1))
    assert daemon.plugin.link is not None
    count = len(node.kubelet.registrations)
    socket = node.socket(node.core)
    socket.unlink()
    socket.mkdir()  # something else took the path: binding fails until it goes
    assert poll(lambda: not daemon.plugin.link.registered.is_set(), 30.0)
    assert daemon.plugin.link.alive()
    socket.rmdir()
    assert node.kubelet.wait_for(
        lambda k: len(k.registrations) >= count + 2 and k.healthy_count(node.core) == 100, 30.0
    )
    assert node.kubelet.admit("p", "c", {node.core: 5}).envs["CUDA_DEVICE_SM_LIMIT"] == "5"


def test_sigterm_stops_streams_removes_sockets_and_exits_zero(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    node.kubelet.start()
    proc = subprocess.Popen(daemon_command(node), stderr=subprocess.PIPE, text=True)
    try:
        assert node.wait_registered(10.0)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert list(Path(node.settings.kubelet_dir).glob("gpushare-*.sock")) == []
    assert '"event": "stopped"' in err


@pytest.mark.skipif(nvml_loads(), reason="a real NVIDIA driver is present")
def test_without_nvml_the_daemon_waits_alive_and_says_why_not_a_crash_loop(
    node: Node,
) -> None:
    port = free_port()
    command = daemon_command(node, port=port)
    at = command.index("--simulate")
    del command[at : at + 2]  # the real NVML, on a machine without a driver
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        # Retried with growing delays (0.5 s, then 1 s): the probe stays alive meanwhile.
        assert poll(lambda: reachable(port), 10.0)
        assert poll(lambda: "cannot initialise NVML" in scrape(port, "/healthz")[1], 30.0)
        assert scrape(port, "/healthz")[0] == 200
        assert scrape(port, "/readyz")[0] == 503  # a rollout waits for this node
        status, text = scrape(port)
        assert status == 200 and "gpushare_ready 0.0" in text
        assert poll(lambda: "attempt 2 failed, next in 1 s" in scrape(port, "/healthz")[1], 30.0)
        assert proc.poll() is None
        assert not list(Path(node.settings.kubelet_dir).glob("gpushare-*.sock"))
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    failures = [line for line in err.splitlines() if '"gpu_discovery_failed"' in line]
    assert len(failures) >= 2, err
    assert "NVIDIA driver" in failures[0] and '"retry_seconds": 0.5' in failures[0]
    assert '"retry_seconds": 1.0' in failures[1]


@pytest.mark.skipif(nvml_loads(), reason="a real NVIDIA driver is present")
def test_without_nvml_fail_on_init_error_exits_1_with_one_line(node: Node) -> None:
    command = daemon_command(node, "--fail-on-init-error")
    at = command.index("--simulate")
    del command[at : at + 2]  # the real NVML, on a machine without a driver
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpushare-device-plugin: cannot initialise NVML")
    assert "NVIDIA driver" in lines[0]


def test_a_missing_library_stops_the_daemon_with_one_line(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    command = daemon_command(node)
    command[command.index("--library") + 1] = "/nonexistent/libvgpu.so"
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert error_lines(result.stderr) == [
        "gpushare-device-plugin: cannot read the interposer library /nonexistent/libvgpu.so: "
        "No such file or directory; set --library, or run with --no-enforcement"
    ]


def test_mig_cards_are_skipped_with_a_log_line(node: Node) -> None:
    gpus = cards(TESLA_P4, 2)
    gpus[1]["mig"] = True
    node.start(gpus)
    assert {d.split("::")[0] for d in node.kubelet.devices(node.memory)} == {gpu_uuid(0)}


def test_a_bad_simulated_node_file_names_the_entry(short_tmp: Path) -> None:
    bad = short_tmp / "node.yaml"
    bad.write_text(yaml.safe_dump({"gpus": [{"uuid": "GPU-1", "memory_mib": "lots"}]}))
    (short_tmp / "dp").mkdir()  # the kubelet's directory, as on a node
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpushare.daemon",
            "--simulate",
            str(bad),
            "--no-enforcement",
            "--kubelet-dir",
            str(short_tmp / "dp"),
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ},
    )
    assert result.returncode == 1
    assert "gpus[0]" in result.stderr and "'memory_mib' must be a int" in result.stderr
