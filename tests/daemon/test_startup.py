"""The start path: what it imports, and the configurations it refuses before serving."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import yaml
from conftest import H200, Node, cards, gpu_uuid
from kit.procs import daemon_command, error_lines

from gpushare.base.startup import ConfigurationTooLarge
from gpushare.deviceplugin.frontdoor import check_message_sizes
from gpushare.gpu.gpus import Gpu
from gpushare.share.devices import Inventory

START_AND_REPORT = textwrap.dedent(
    """
    import sys
    from gpushare.config import load_settings
    from gpushare.daemon import Daemon
    daemon = Daemon(load_settings(sys.argv[1:]))
    daemon.start()
    registered = daemon.plugin.link.registered.wait(20)
    slow = sorted(m for m in sys.modules if m.split(".")[0] == "kubernetes")
    daemon.stop()
    print(registered, slow, flush=True)
    """
)


def test_starting_the_daemon_does_not_import_the_kubernetes_client(node: Node) -> None:
    node.write_gpus(cards(H200, 8))
    node.kubelet.start()
    command = daemon_command(node, "--log-level", "error")
    command[1:3] = ["-c", START_AND_REPORT]  # the daemon's start, then a report
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "True []"  # registered; nothing of kubernetes
    # The daemon stopped right after registering, perhaps before the kubelet opened
    # ListAndWatch: what the kubelet must have seen is the two registrations.
    resources = {node.memory, node.core}
    assert node.kubelet.wait_for(
        lambda k: {resource for resource, _ in k.registrations} == resources, 30.0
    )


def big_node(count: int, memory_mib: int) -> list[dict[str, object]]:
    return [
        {"uuid": gpu_uuid(i), "name": "192 GiB card", "memory_mib": memory_mib}
        for i in range(count)
    ]


def test_a_unit_too_small_for_the_kubelets_message_limit_exits_2_naming_the_fix(
    short_tmp: Path,
) -> None:
    node_file = short_tmp / "node.yaml"
    node_file.write_text(yaml.safe_dump({"gpus": big_node(16, 192 * 1024)}))
    (short_tmp / "dp").mkdir()  # the kubelet's directory, as on a node
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpushare.daemon",
            "--simulate",
            str(node_file),
            "--no-enforcement",
            "--kubelet-dir",
            str(short_tmp / "dp"),
            "--metrics-port",
            "0",
            "--memory-unit-mib",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert "196608 units of 16 MiB" in lines[0]
    assert "kubelet's 4 MiB gRPC message limit" in lines[0]
    assert lines[0].endswith("use a larger memory unit: --memory-unit-mib 64 or more")
    assert not list((short_tmp / "dp").iterdir())  # refused before serving anything


def test_the_default_unit_fits_sixteen_192_gib_cards_and_the_suggestion_fits() -> None:
    gpus = [
        Gpu(uuid=gpu_uuid(i), name="big", memory_mib=192 * 1024, index=i, minor=i)
        for i in range(16)
    ]
    check_message_sizes(Inventory(gpus, 256))  # 12288 units: well inside
    check_message_sizes(Inventory(gpus, 64))  # the unit suggested below
    try:
        check_message_sizes(Inventory(gpus, 32))
    except ConfigurationTooLarge as exc:
        assert exc.exit_code == 2
        assert "--memory-unit-mib 64 or more" in str(exc)
    else:
        raise AssertionError("98304 units must not fit in 3 MiB")
