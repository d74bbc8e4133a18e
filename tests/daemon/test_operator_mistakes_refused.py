"""Mistakes an operator makes are refused with a line that says what to do,
or logged where the operator looks, never silently accepted."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import TESLA_P4, Node, cards
from kit.procs import daemon_command, error_lines, free_port, poll, scrape
from structlog.testing import capture_logs

from gpushare.base.startup import BadKubeletDir, BadLibrary, StartupError
from gpushare.daemon import Daemon
from gpushare.deviceplugin.registration import MISSING_LOG_SECONDS, KubeletLink
from gpushare.host.elf import NotASharedObject, check_shared_object, stand_in

OTHER_MACHINE = "aarch64" if platform.machine() in ("x86_64", "amd64") else "x86_64"


# -- the simulated GPU file ----------------------------------------------------------------


@pytest.mark.parametrize(
    "content,key",
    [
        ({"gpus": [{"uuid": "GPU-1", "memory_mib": 4096, "xids": 79}]}, "'xids'"),
        ({"gpus": [{"uuid": "GPU-1", "memory_mib": 4096}], "gpu": []}, "'gpu'"),
    ],
)
def test_unknown_keys_in_the_simulated_node_file_are_refused(
    node: Node, content: dict[str, object], key: str
) -> None:
    node.gpus_file.write_text(yaml.safe_dump(content))
    node.kubelet.start()
    with pytest.raises(StartupError) as error:
        Daemon(node.settings).start()
    assert f"unknown key {key}" in str(error.value)
    assert "known keys:" in str(error.value)


# -- the interposer library ------------------------------------------------------------------


def test_the_library_must_be_an_elf_shared_object_of_this_machine(tmp_path: Path) -> None:
    good = tmp_path / "good.so"
    good.write_bytes(stand_in(b"x"))
    check_shared_object(good)  # no exception
    cases = {
        "text": (b"root:x:0:0:root:/root:/bin/bash\n", "not an ELF file"),
        "other-arch": (stand_in(b"x", machine=OTHER_MACHINE), "built for"),
        "executable": (stand_in(b"x")[:16] + b"\x02\x00" + stand_in(b"x")[18:], "not a shared"),
        "32-bit": (b"\x7fELF\x01" + stand_in(b"x")[5:], "not a 64-bit"),
        "short": (b"\x7fELF", "not an ELF file"),
    }
    for name, (content, expected) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(NotASharedObject, match=expected):
            check_shared_object(path)


def test_a_library_that_cannot_enforce_anything_stops_the_daemon_with_one_line(
    node: Node,
) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    command = daemon_command(node)
    command[command.index("--library") + 1] = "/etc/passwd"
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    (line,) = error_lines(result.stderr)
    assert line.startswith("gpushare-device-plugin: --library /etc/passwd is not an ELF file")
    assert "--no-enforcement" in line
    node.library.write_bytes(stand_in(b"x", machine=OTHER_MACHINE))
    with pytest.raises(BadLibrary, match="built for"):
        Daemon(node.settings).start()


# -- the kubelet directory and socket ---------------------------------------------------------


def test_a_kubelet_dir_that_does_not_exist_is_refused_not_created(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    missing = node.root / "no-such-kubelet" / "device-plugins"
    settings = replace(node.settings, kubelet_dir=str(missing))
    with pytest.raises(BadKubeletDir) as error:
        Daemon(settings).start()
    assert error.value.exit_code == 2
    assert f"--kubelet-dir {missing} does not exist" in str(error.value)
    assert not missing.exists() and not missing.parent.exists()


@pytest.mark.parametrize("wrong", ["kubelet-dir", "library"])
def test_a_wrong_path_is_refused_with_exit_2_while_nvml_is_missing(
    short_tmp: Path, wrong: str
) -> None:
    """Issue 33.8: without a readable NVML (here: none, and no --simulate) the daemon waits
    for the GPUs; a wrong --kubelet-dir or --library was only reported once NVML worked.
    Both need no GPU and are checked first: exit 2, as documented, with one line."""
    library = short_tmp / "not-elf.so"
    library.write_text("not a shared object\n")
    good_dir = short_tmp / "device-plugins"
    good_dir.mkdir()
    flags = {
        "kubelet-dir": ["--kubelet-dir", str(short_tmp / "missing"), "--no-enforcement"],
        "library": ["--kubelet-dir", str(good_dir), "--library", str(library)],
    }[wrong]
    done = subprocess.run(
        [str(Path(sys.executable).with_name("gpushare-device-plugin")), *flags,
         "--metrics-port", "0", "--node-name", "", "--log-format", "json"],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(short_tmp)},  # no libnvidia-ml
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if not x.startswith("{")]
    assert f"--{wrong} " in line
    assert "gpu_discovery_failed" not in done.stderr + done.stdout


def test_a_missing_kubelet_socket_is_logged_at_once_then_every_minute(short_tmp: Path) -> None:
    link = KubeletLink(short_tmp / "kubelet.sock", [])
    try:
        with capture_logs() as logs:
            link._check_once()
            link._check_once()  # a moment later: not again
            link._missing_logged_at -= MISSING_LOG_SECONDS  # a minute on
            link._missing_since = (link._missing_since or 0.0) - MISSING_LOG_SECONDS
            link._check_once()
        missing = [entry for entry in logs if entry["event"] == "kubelet_socket_missing"]
        assert len(missing) == 2
        assert missing[0]["socket"] == str(short_tmp / "kubelet.sock")
        assert missing[1]["missing_seconds"] >= MISSING_LOG_SECONDS
        assert "--kubelet-dir" in missing[0]["hint"]
    finally:
        link._watch.close()


def test_a_daemon_started_before_the_kubelet_says_so_in_its_log(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    Path(node.settings.kubelet_dir).mkdir(parents=True)
    proc = subprocess.Popen(daemon_command(node), stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("{") and json.loads(line)["event"] == "kubelet_socket_missing":
                break
        else:
            pytest.fail("no kubelet_socket_missing line")
    finally:
        proc.kill()
        proc.wait(10)


# -- no usable GPU ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mig", "reason"),
    [(False, "no usable GPU"), (True, "is in MIG mode or changing to it")],
)
def test_zero_usable_gpus_is_a_warning_and_not_ready(node: Node, mig: bool, reason: str) -> None:
    gpus = cards(TESLA_P4, 1) if mig else []
    if mig:
        gpus[0]["mig"] = True
    port = free_port()
    node.write_gpus(gpus)
    node.settings = replace(node.settings, metrics_port=port, metrics_address="127.0.0.1")
    node.kubelet.start()
    node.daemon = Daemon(node.settings)
    with capture_logs() as logs:
        node.daemon.start()
    assert node.kubelet.wait_for(lambda k: len(k.registrations) == 2)  # registered, empty
    assert any(entry["event"] == "no_usable_gpus" for entry in logs)
    # registration is seen by the kubelet a moment before the daemon records it: wait for
    # the reason that stays (503 "not registered" may come first)
    assert poll(lambda: reason in json.loads(scrape(port, "/readyz")[1])["reason"], 30.0)
    assert scrape(port, "/readyz")[0] == 503
    assert "gpushare_ready 0.0" in scrape(port)[1]
    assert scrape(port, "/healthz")[0] == 200  # a restart would not help
