"""The MPS control daemon's own lifecycle, against a stand-in executable at the edge:
started with -d (and -M where offered; -p 3 with its configuration where v3 is offered)
with its pipe and log directories under the host directory, commands answered,
restarted with its caps when it dies, stopped with quit (v3: -q)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from kit.mps import install_standin, pid_alive, standin_state
from kit.procs import poll

from gpushare.host.mps import (
    CONFIG_FILE,
    SERVER,
    Cap,
    MpsControl,
    MpsError,
    available,
    mps_dirs,
    probe,
)


@pytest.fixture
def control(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> MpsControl:
    monkeypatch.setenv("STANDIN_MPS_V3", "1")
    exe = install_standin(short_tmp / "bin")
    return MpsControl(exe, short_tmp / "vgpu", backoff=(0.05, 0.2))


def test_started_multi_user_with_dirs_under_the_host_dir(
    control: MpsControl, short_tmp: Path
) -> None:
    control.start()
    try:
        pipe, logs = mps_dirs(short_tmp / "vgpu")
        assert (control.pipe_dir, control.log_dir) == (pipe, logs)
        assert control.pid is not None and pid_alive(control.pid)
        state = standin_state(pipe)
        assert state["multi_user"] is True and state["pid"] == control.pid
        assert control.capabilities.namespaces
        # v3 where offered: -p 3, and the server of every namespace from the config file
        assert state["protocol"] == 3
        assert state["config"]["servers"] == {SERVER: {"uid": 0}}
        assert (logs / CONFIG_FILE).stat().st_mode & 0o077 == 0
        with pytest.raises(MpsError, match="invalid command"):
            control.command_v3("create", name="")
    finally:
        control.stop()


def test_legacy_commands_on_a_daemon_without_v3(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STANDIN_MPS_V3", raising=False)
    control = MpsControl(install_standin(short_tmp / "bin"), short_tmp / "vgpu")
    control.start()
    try:
        assert standin_state(control.pipe_dir)["protocol"] == 2
        assert control.command("set_default_active_thread_percentage 40") == "40"
        assert control.command("get_default_active_thread_percentage") == "40"
        assert control.command("get_server_list") == ""
        with pytest.raises(MpsError, match="invalid command"):
            control.command("no_such_command")
    finally:
        control.stop()


def test_stop_sends_quit_and_the_daemon_is_gone(control: MpsControl) -> None:
    control.start()
    pid = control.pid
    assert pid is not None
    control.stop()
    assert not pid_alive(pid)
    assert not (control.pipe_dir / "nvidia-cuda-mps-control.pid").exists()  # quit, not kill


def test_restarted_when_it_dies_and_caps_reapplied(control: MpsControl, short_tmp: Path) -> None:
    control.start()
    try:
        pipe = control.cap("c-a", Cap(short_tmp / "marker-a", percent=30, memory_mib=1024))
        assert pipe == control.pipe_dir / SERVER / "c-a" and pipe.is_dir()
        assert (pipe / "control").is_socket()  # the documented routing: <server>/<ns>/control
        first = control.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert control.wait_started(2, timeout=60)
        assert control.pid != first and pid_alive(control.pid or 0)
        # the new daemon knows the namespace again, with its cap, from its configuration
        want = {"pipe": str(pipe), "percent": 30, "mib": 1024}
        assert poll(lambda: standin_state(control.pipe_dir)["namespaces"].get("c-a") == want, 60)
    finally:
        control.stop()


def test_without_namespaces_a_cap_is_refused(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STANDIN_MPS_V3", raising=False)
    monkeypatch.setenv("STANDIN_MPS_NO_MULTIUSER", "1")
    exe = install_standin(short_tmp / "bin")
    control = MpsControl(exe, short_tmp / "vgpu")
    control.start()
    try:
        assert not control.capabilities.namespaces
        assert standin_state(control.pipe_dir)["multi_user"] is False  # no -M where not offered
        with pytest.raises(MpsError, match="no namespaces"):
            control.cap("c-a", Cap(short_tmp / "x", percent=10))
        assert standin_state(control.pipe_dir)["protocol"] == 2
    finally:
        control.stop()


def test_a_daemon_that_will_not_start_is_one_line(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_MPS_FAIL_START", "1")
    exe = install_standin(short_tmp / "bin")
    with pytest.raises(MpsError, match="exited 1: cannot start") as caught:
        MpsControl(exe, short_tmp / "vgpu").start()
    assert "\n" not in str(caught.value)


def test_available_and_probe(short_tmp: Path) -> None:
    assert available("") == "no mpsControl configured"
    assert "does not exist" in (available(str(short_tmp / "none")) or "")
    plain = short_tmp / "plain"
    plain.write_text("")
    assert "not executable" in (available(str(plain)) or "")
    exe = install_standin(short_tmp / "bin")
    assert available(str(exe)) is None
    caps = probe(exe, {"PATH": os.environ.get("PATH", "")})
    assert caps.multi_user and not caps.namespaces
