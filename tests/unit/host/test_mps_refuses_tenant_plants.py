"""A tenant cannot make the root MPS control daemon write where the tenant chose.

Containers mount their pipe directory read-only (``share/answers.py``); this file shows
what that buys (a client still reaches its socket, nothing can be planted) and what the
supervisor does about plants that got there anyway (a container from before the mount
was read-only, the shared ``shm`` directory): before every (re)start of the control
daemon they are removed, so the daemon (the stand-in writes as carelessly as a root
daemon could: by name, following links, opening FIFOs) writes nothing outside its own
directories and does not block; and the supervisor reads the pid file without following
a link or opening a FIFO.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit.mps import install_standin, pid_alive, standin_state

from gpushare.host import mpsdirs
from gpushare.host.mps import PID_FILE, SERVER, Cap, MpsControl, mps_shm_dir
from gpushare.share.answers import CONTAINER_MPS_PIPE, Enforcement, container_edits, share

SECRET = "the host's file, not the daemon's\n"


def outside(root: Path) -> tuple[Path, Path]:
    """A file and a directory outside the MPS directories, as a tenant would aim at."""
    where = root / "outside"
    where.mkdir()
    secret = where / "secret"
    secret.write_text(SECRET)
    target_dir = where / "dir"
    target_dir.mkdir()
    return secret, target_dir


def untouched(secret: Path, target_dir: Path) -> bool:
    return secret.read_text() == SECRET and not any(target_dir.iterdir())


def plant(pipe: Path, shm: Path, secret: Path, target_dir: Path, *, v3: bool) -> None:
    """What a tenant with a writable mount of the pipe directory (and shm) would leave:
    the daemon's own file names as links to the host and as FIFOs."""
    for name in (PID_FILE, "standin-state.json", "control"):
        if os.path.lexists(pipe / name):
            os.unlink(pipe / name)
    (pipe / PID_FILE).symlink_to(secret)
    os.mkfifo(pipe / "standin-state.json")  # a careless open blocks on it
    os.mkfifo(pipe / "control")
    if v3:  # the server's directory swapped for a link: namespaces would be made outside
        shutil.rmtree(pipe / SERVER)
        (pipe / SERVER).symlink_to(target_dir, target_is_directory=True)
    (shm / "cuda.shm.0").symlink_to(secret)
    os.mkfifo(shm / "cuda.shm.1")


@pytest.mark.parametrize("v3", [False, True], ids=["legacy", "v3"])
def test_plants_are_gone_before_the_daemon_restarts(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, v3: bool
) -> None:
    if v3:
        monkeypatch.setenv("STANDIN_MPS_V3", "1")
    else:
        monkeypatch.delenv("STANDIN_MPS_V3", raising=False)
    secret, target_dir = outside(short_tmp)
    host = short_tmp / "vgpu"
    control = MpsControl(install_standin(short_tmp / "bin"), host, backoff=(0.05, 0.2))
    control.start()
    try:
        if v3:
            control.cap("c-a", Cap(short_tmp / "marker", percent=30))
        first = control.pid
        assert first is not None
        plant(control.pipe_dir, mps_shm_dir(host), secret, target_dir, v3=v3)
        os.kill(first, signal.SIGKILL)
        # restarted: it did not block on a FIFO, nor did the supervisor
        assert control.wait_started(2, timeout=60)
        assert control.pid != first and pid_alive(control.pid or 0)
        assert untouched(secret, target_dir)
        pid_file = os.lstat(control.pipe_dir / PID_FILE)
        assert stat.S_ISREG(pid_file.st_mode)
        assert standin_state(control.pipe_dir)["pid"] == control.pid
        assert stat.S_ISSOCK(os.lstat(control.pipe_dir / "control").st_mode)
        assert sorted(os.listdir(mps_shm_dir(host))) == []
        if v3:  # the server's directory is real again and the namespace is back in it
            assert stat.S_ISDIR(os.lstat(control.pipe_dir / SERVER).st_mode)
            assert (control.pipe_dir / SERVER / "c-a" / "control").is_socket()
        control.stop()
        assert untouched(secret, target_dir) and not pid_alive(control.pid or 0)
    finally:
        control.stop()


def test_the_pipe_directory_itself_swapped_for_a_link_is_made_again(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STANDIN_MPS_V3", raising=False)
    secret, target_dir = outside(short_tmp)
    control = MpsControl(install_standin(short_tmp / "bin"), short_tmp / "vgpu")
    control.pipe_dir.parent.mkdir(parents=True)
    control.pipe_dir.symlink_to(target_dir, target_is_directory=True)
    (control.pipe_dir.parent / "shm").symlink_to(target_dir, target_is_directory=True)
    control.start()
    try:
        for path in (control.pipe_dir, control.pipe_dir.parent / "shm"):
            info = os.lstat(path)
            assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
        assert stat.S_IMODE(os.lstat(control.pipe_dir.parent / "shm").st_mode) == 0o1777
        assert untouched(secret, target_dir)
    finally:
        control.stop()


def test_the_pid_file_is_read_without_following_or_blocking(short_tmp: Path) -> None:
    good = short_tmp / "good"
    good.write_text("1234\n")
    assert mpsdirs.read_pid_file(good) == 1234
    link = short_tmp / "link"
    link.symlink_to(good)
    assert mpsdirs.read_pid_file(link) is None
    fifo = short_tmp / "fifo"
    os.mkfifo(fifo)
    assert mpsdirs.read_pid_file(fifo) is None  # returns: an open that blocked would hang
    (short_tmp / "words").write_text("12 34")
    assert mpsdirs.read_pid_file(short_tmp / "words") is None
    (short_tmp / "long").write_text("9" * 100)
    assert mpsdirs.read_pid_file(short_tmp / "long") is None
    (short_tmp / "dir").mkdir()
    assert mpsdirs.read_pid_file(short_tmp / "dir") is None
    assert mpsdirs.read_pid_file(short_tmp / "missing") is None


KINDS = ("file", "fifo", "link-file", "link-dir", "dir", "socket")
plants = st.lists(
    st.tuples(
        st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=4),
        st.sampled_from(KINDS),
    ),
    max_size=12,
)


def make(path: Path, kind: str, secret: Path, target_dir: Path) -> None:
    """One plant at ``path`` (its parents made as directories where free)."""
    for parent in reversed(path.parents):
        if not os.path.lexists(parent):
            parent.mkdir()
        elif not parent.is_dir() or parent.is_symlink():
            return  # a non-directory already holds this name
    if os.path.lexists(path):
        return
    if kind == "file":
        path.write_text("x")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-file":
        path.symlink_to(secret)
    elif kind == "link-dir":
        path.symlink_to(target_dir, target_is_directory=True)
    elif kind == "dir":
        path.mkdir()
    else:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plants)
def test_the_cleared_pipe_tree_holds_only_real_directories_within_two_levels(
    planted: list[tuple[list[str], str]],
) -> None:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    try:
        secret, target_dir = outside(root)
        pipe = root / "pipe"
        pipe.mkdir()
        for parts, kind in planted:
            make(pipe.joinpath(*parts), kind, secret, target_dir)
        mpsdirs.clear_pipe_tree(pipe)
        for dirpath, dirnames, filenames in os.walk(pipe):  # never follows links
            depth = len(Path(dirpath).relative_to(pipe).parts)
            assert not filenames, (dirpath, filenames)
            for name in dirnames:
                info = os.lstat(Path(dirpath) / name)
                assert stat.S_ISDIR(info.st_mode) and depth < mpsdirs.PIPE_DEPTH
        assert untouched(secret, target_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("own", [False, True], ids=["shared pipe", "own namespace"])
def test_answers_mount_the_pipe_directory_read_only(short_tmp: Path, own: bool) -> None:
    uuid = "GPU-0"
    enforcement = Enforcement(None, None, False, compute={uuid: "mps"}, mps_pipe=short_tmp / "pipe")
    pipe = short_tmp / "pipe" / SERVER / "c-a" if own else None
    grant = share(uuid, enforcement=enforcement, memory_mib=1024, cores=30, mps_pipe=pipe)
    answer = container_edits(grant)
    (mount,) = [m for m in answer.mounts if m.container_path == CONTAINER_MPS_PIPE]
    assert mount.read_only and mount.host_path == str(pipe or short_tmp / "pipe")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    return done.returncode == 0


CLIENT = """
import os, socket, sys
where = sys.argv[1]
client = socket.socket(socket.AF_UNIX)
client.connect(os.path.join(where, "control"))
try:
    open(os.path.join(where, "planted"), "w")
except OSError as exc:
    print("write refused", exc.errno)
else:
    print("write allowed")
print("connected")
"""


@pytest.mark.skipif(not _unshare_works(), reason="no user and mount namespaces here")
def test_a_client_reaches_its_namespace_through_a_read_only_mount(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in a container: the namespace directory bind-mounted read-only; the client
    connects to its ``control`` socket and cannot create anything there."""
    import errno

    monkeypatch.setenv("STANDIN_MPS_V3", "1")
    control = MpsControl(install_standin(short_tmp / "bin"), short_tmp / "vgpu")
    control.start()
    try:
        pipe = control.cap("c-a", Cap(short_tmp / "marker", percent=30))
        seen = short_tmp / "container-view"
        seen.mkdir()
        script = (
            f"mount --bind {pipe} {seen} && mount -o remount,bind,ro {seen} && "
            f"{sys.executable} -c '{CLIENT}' {seen}"
        )
        done = subprocess.run(
            ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[:2] == [f"write refused {errno.EROFS}", "connected"]
        assert not (pipe / "planted").exists()
    finally:
        control.stop()
