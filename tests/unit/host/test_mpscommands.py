"""Speaking to the running MPS control daemon (``host/mpscommands.py``), against the
stand-in executable at the edge (``tests/kit/standin/mps_control.py``), started and
stopped by gpushare's own supervisor.

What it proves: a legacy command goes on stdin and its answer comes back; a v3 command
goes as arguments with the documented verbs; every failure (two lines, an unknown
command, an error answer, a missing executable, no daemon to reach) is an MpsError of
one line; a namespace is created once, capped, given a real pipe directory of ours and
kept, and a cap that cannot be set leaves the one before it kept; a namespace name that
could leave the pipe directory is refused before anything is sent; the v3
configuration names every kept namespace with its caps.
"""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kit.mps import install_standin, standin_state

from gpushare.host.library import cache_key
from gpushare.host.mps import MpsControl
from gpushare.host.mpscommands import (
    PIPE_MODE,
    SERVER,
    V3,
    Cap,
    MpsCommands,
    MpsError,
    NamespaceCaps,
    namespace_pipe,
    v3_config,
)


def running(short_tmp: Path) -> Iterator[tuple[MpsCommands, Path]]:
    exe = install_standin(short_tmp / "bin")
    control = MpsControl(exe, short_tmp / "vgpu")
    control.start()
    try:
        yield MpsCommands(exe, control.pipe_dir, control.log_dir), control.pipe_dir
    finally:
        control.stop()


@pytest.fixture
def legacy(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[MpsCommands, Path]]:
    monkeypatch.delenv("STANDIN_MPS_V3", raising=False)
    yield from running(short_tmp)


@pytest.fixture
def v3(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[MpsCommands, Path]]:
    monkeypatch.setenv("STANDIN_MPS_V3", "1")
    yield from running(short_tmp)


def one_line_error(exc: pytest.ExceptionInfo[MpsError]) -> str:
    text = str(exc.value)
    assert text and "\n" not in text
    return text


# -- the commands -----------------------------------------------------------------------


def test_a_legacy_command_goes_on_stdin_and_its_answer_comes_back(
    legacy: tuple[MpsCommands, Path],
) -> None:
    commands, pipe = legacy
    assert commands.command("set_default_active_thread_percentage 40") == "40"
    assert standin_state(pipe)["default_percent"] == 40
    assert commands.command("get_default_active_thread_percentage") == "40"


def test_every_failure_of_a_legacy_command_is_one_line(
    legacy: tuple[MpsCommands, Path], short_tmp: Path
) -> None:
    commands, pipe = legacy
    with pytest.raises(MpsError) as two:
        commands.command("set_default_active_thread_percentage 10\nquit")
    assert one_line_error(two) == "one command per line"
    assert standin_state(pipe)["default_percent"] == 100  # nothing of it was sent
    with pytest.raises(MpsError) as unknown:
        commands.command("no_such_command 1")
    assert one_line_error(unknown).startswith("MPS control command 'no_such_command': invalid")
    missing = MpsCommands(short_tmp / "absent", pipe, commands.log_dir)
    with pytest.raises(MpsError) as gone:
        missing.command("get_server_list")
    assert one_line_error(gone).startswith("MPS control command 'get_server_list' failed: ")
    nobody = MpsCommands(commands.executable, short_tmp / "no-daemon", commands.log_dir)
    with pytest.raises(MpsError) as unreached:
        nobody.command("get_server_list")
    assert one_line_error(unreached).startswith(
        "MPS control command 'get_server_list' exited 1: cannot reach the control daemon"
    )


def test_the_daemons_directories_ride_in_the_environment(short_tmp: Path) -> None:
    commands = MpsCommands(short_tmp / "exe", short_tmp / "pipe", short_tmp / "log")
    env = commands.env()
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(short_tmp / "pipe")
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(short_tmp / "log")
    assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is kept


def test_v3_commands_create_cap_and_delete_a_namespace(v3: tuple[MpsCommands, Path]) -> None:
    commands, pipe = v3
    commands.command_v3("create", name="c-one")
    commands.command_v3("threads", name="c-one", percent=25)
    commands.command_v3("memory", name="c-one", mib=512)
    namespace = standin_state(pipe)["namespaces"]["c-one"]
    assert (namespace["percent"], namespace["mib"]) == (25, 512)
    assert namespace["pipe"] == str(pipe / SERVER / "c-one")  # on the one server
    commands.command_v3("remove", name="c-one")
    assert "c-one" not in standin_state(pipe)["namespaces"]
    with pytest.raises(MpsError) as refused:
        commands.command_v3("threads", name="c-none", percent=5)
    assert one_line_error(refused) == (
        "MPS v3 command 'namespace set' exited 0: error: no such namespace"
    )


def test_the_v3_verbs_are_the_documented_ones() -> None:
    assert {verb: words[:2] for verb, words in V3.items() if verb != "quit"} == {
        "create": ("namespace", "create"),
        "threads": ("namespace", "set"),
        "memory": ("namespace", "set"),
        "remove": ("namespace", "delete"),
    }
    assert all("--server={server}" in words for verb, words in V3.items() if verb != "quit")


# -- the namespaces' caps ---------------------------------------------------------------


def test_a_cap_makes_the_namespace_its_pipe_directory_and_is_kept(
    v3: tuple[MpsCommands, Path], short_tmp: Path
) -> None:
    commands, pipe = v3
    caps = NamespaceCaps(commands, pipe)
    first = Cap(short_tmp / "marker", percent=30, memory_mib=1024)
    where = caps.cap("c-a", first)
    assert where == namespace_pipe(pipe, "c-a") == pipe / SERVER / "c-a"
    info = os.lstat(where)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
    assert stat.S_IMODE(info.st_mode) == PIPE_MODE
    assert caps.caps() == {"c-a": first}
    got = standin_state(pipe)["namespaces"]["c-a"]
    assert (got["percent"], got["mib"]) == (30, 1024)
    # re-capped: the namespace keeps its directory, the new cap is set and kept
    second = Cap(first.marker, percent=60)
    assert caps.cap("c-a", second) == where
    assert standin_state(pipe)["namespaces"]["c-a"]["percent"] == 60
    assert caps.caps() == {"c-a": second}
    # the configuration a restart starts from names it with its cap
    config = tomllib.loads(v3_config(caps.caps()))
    assert config["servers"][SERVER]["namespaces"] == {"c-a": {"active_thread_percentage": "60"}}


def test_a_cap_that_cannot_be_set_leaves_the_one_before(
    v3: tuple[MpsCommands, Path], short_tmp: Path
) -> None:
    commands, pipe = v3
    caps = NamespaceCaps(commands, pipe)
    kept = Cap(short_tmp / "marker", percent=30, memory_mib=256)
    caps.cap("c-a", kept)
    caps.commands = MpsCommands(short_tmp / "absent", pipe, commands.log_dir)
    with pytest.raises(MpsError) as again:
        caps.cap("c-a", Cap(kept.marker, percent=90))
    assert one_line_error(again).startswith("cannot cap MPS namespace c-a: ")
    with pytest.raises(MpsError) as fresh:
        caps.cap("c-b", Cap(kept.marker, percent=10))
    assert one_line_error(fresh).startswith("cannot cap MPS namespace c-b: ")
    assert caps.caps() == {"c-a": kept}  # what a restart re-applies


@pytest.mark.parametrize("name", ["", ".", "..", "../escape", "a/b", "/abs"])
def test_a_name_that_is_no_namespace_name_is_refused_before_anything_is_sent(
    v3: tuple[MpsCommands, Path], short_tmp: Path, name: str
) -> None:
    commands, pipe = v3
    caps = NamespaceCaps(commands, pipe)
    with pytest.raises(MpsError, match="is not a namespace name"):
        caps.cap(name, Cap(short_tmp / "marker", percent=10))
    assert caps.caps() == {}
    assert standin_state(pipe)["namespaces"] == {}


def test_forget_deletes_the_namespace_and_its_directory(
    v3: tuple[MpsCommands, Path], short_tmp: Path
) -> None:
    commands, pipe = v3
    caps = NamespaceCaps(commands, pipe)
    where = caps.cap("c-a", Cap(short_tmp / "marker", percent=30))
    caps.cap("c-b", Cap(short_tmp / "marker-b", percent=40))
    caps.forget("c-a")
    assert not os.path.lexists(where)
    assert set(standin_state(pipe)["namespaces"]) == {"c-b"}
    assert set(caps.caps()) == {"c-b"}
    caps.forget("c-a")  # unknown now: nothing sent, nothing raised
    caps.forget("c-never")
    assert set(standin_state(pipe)["namespaces"]) == {"c-b"}


# -- pure: the configuration and the pipe directories ----------------------------------

names = st.one_of(
    st.from_regex(r"[a-z0-9][a-z0-9-]{0,20}", fullmatch=True),
    st.lists(st.text(min_size=1, max_size=8), max_size=3).map(cache_key),
)
caps_strategy = st.builds(
    Cap, st.just(Path("/m")), st.integers(1, 100), st.one_of(st.none(), st.integers(1, 1 << 20))
)


@given(st.dictionaries(names, caps_strategy, max_size=6))
def test_the_v3_configuration_names_every_namespace_with_its_caps(caps: dict[str, Cap]) -> None:
    config = tomllib.loads(v3_config(caps))
    assert config["schema_version"] == "1.0"
    server = config["servers"][SERVER]
    assert list(config["servers"]) == [SERVER] and server["uid"] == 0
    written = server.get("namespaces", {})
    assert set(written) == set(caps)
    for name, cap in caps.items():
        want = {"active_thread_percentage": str(cap.percent)}
        if cap.memory_mib is not None:
            want["pinned_memory_limit"] = f"{cap.memory_mib}M"
        assert written[name] == want


@given(names)
def test_a_namespaces_pipe_directory_is_under_the_servers(name: str) -> None:
    pipe = Path("/host/mps/pipe")
    where = namespace_pipe(pipe, name)
    assert where == pipe / SERVER / name and where.parent.parent == pipe


@given(
    st.one_of(
        st.sampled_from(["", ".", ".."]),
        st.builds("{}/{}".format, st.text(max_size=6), st.text(max_size=6)),
    )
)
def test_a_name_that_could_leave_the_pipe_directory_is_refused(name: str) -> None:
    with pytest.raises(MpsError, match="is not a namespace name"):
        namespace_pipe(Path("/host/mps/pipe"), name)
