"""The driver memory hook (hook/memory-hook.c), run as a container runtime runs a
createRuntime hook: the OCI state on stdin, the card and the limit in its arguments,
against a stand-in cgroup v2 tree, a stand-in /proc and the stand-in NVML whose limits
the Python simulation reads (tests/kit/standin/libnvml_standin.c, gpu/memlimits.py).

Everything it is given is hostile until checked: a gone pid, a cgroup outside the root
(``..``), a symlink anywhere on the path, the root cgroup, an oversized or malformed
state, a duplicated or nested ``pid``, bad arguments, an NVML that refuses or does not
keep the limit. Each is refused with a non-zero exit and one line on stderr, and nothing
is written anywhere (the world's whole tree is compared before and after).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit.memhook import HAVE_GCC, UUID, HookWorld, build, oci_state, tree

from gpushare.gpu.memlimits import MemoryLimits

pytestmark = pytest.mark.skipif(not HAVE_GCC, reason="needs gcc")

PID = 4242
LEAF = "/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build(tmp_path_factory.mktemp("hook"))


@pytest.fixture
def world(built: tuple[Path, Path], tmp_path: Path) -> HookWorld:
    return HookWorld(tmp_path, *built)


def refused(world: HookWorld, state: object, says: str, **kw: object) -> None:
    before = tree(world.base)
    result = world.run(state, **kw)  # type: ignore[arg-type]
    assert result.returncode != 0, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert lines[0].startswith("gpushare-memory-hook: ") or says.startswith("usage")
    assert tree(world.base) == before  # nothing written anywhere
    assert world.store.limits() == {}


def test_sets_the_hard_limit_on_the_containers_own_cgroup(world: HookWorld) -> None:
    namespace = world.container(PID, LEAF)
    result = world.run(oci_state(PID))
    assert result.returncode == 0 and result.stderr == "", result
    assert world.store.limits() == {(UUID, namespace): MemoryLimits(0, 512 << 20)}
    # the Python simulation reads what the hook set through the C stand-in
    assert world.store.get_memory_limits(UUID, namespace) == MemoryLimits(0, 512 << 20)


def test_a_nested_pid_is_not_the_containers(world: HookWorld) -> None:
    namespace = world.container(PID, LEAF)
    world.container(7, "/other")
    state = oci_state(PID, annotations={"pid": 7, "x": [{"pid": 7}]})
    assert world.run(state).returncode == 0
    assert list(world.store.limits()) == [(UUID, namespace)]


def test_a_gone_pid(world: HookWorld) -> None:
    refused(world, oci_state(999), "process 999 is gone")


@pytest.mark.parametrize(
    "line, says",
    [
        ("0::/kubepods/../../etc", ".. component"),
        ("0::/kubepods/./x", ". or .. component"),
        ("0::/kubepods//x", "empty"),
        ("0::/kubepods/x/", "empty"),
        ("0::/", "root cgroup"),
        ("0::kubepods", "not a path"),
        ("1:memory:/kubepods\n", "no cgroup v2 directory"),
        ("0::/a\n0::/b\n", "two cgroup v2 lines"),
        ("0::/not/made\n", "cannot open the cgroup"),
    ],
)
def test_a_cgroup_outside_or_odd_is_refused(world: HookWorld, line: str, says: str) -> None:
    world.container(PID, "/a", text=line)
    world.container(PID + 1, "/b")
    world.container(PID + 2, "/kubepods/x")
    refused(world, oci_state(PID), says)


def test_a_symlink_anywhere_on_the_path_is_refused(world: HookWorld, tmp_path: Path) -> None:
    outside = tmp_path / "outside" / "leaf"
    outside.mkdir(parents=True)
    (world.cgroup / "kubepods").mkdir()
    os.symlink(tmp_path / "outside", world.cgroup / "kubepods" / "pod")
    world.container(PID, "/kubepods/pod/leaf", make=False)
    refused(world, oci_state(PID), "symlink")
    os.symlink(outside, world.cgroup / "kubepods" / "leaf2")
    world.container(PID, "/kubepods/leaf2", make=False)
    refused(world, oci_state(PID), "symlink")


def test_a_file_where_a_directory_should_be(world: HookWorld) -> None:
    (world.cgroup / "kubepods").mkdir()
    (world.cgroup / "kubepods" / "f").write_text("")
    world.container(PID, "/kubepods/f", make=False)
    refused(world, oci_state(PID), "non-directory")


def test_an_oversized_proc_cgroup_file(world: HookWorld) -> None:
    world.container(PID, "/a", text="1:x:/" + "a" * (20 << 10) + "\n0::/a\n")
    refused(world, oci_state(PID), "larger than")


@pytest.mark.parametrize(
    "state, says",
    [
        (json.dumps(oci_state(PID, pad="x" * (64 << 10))), "larger than 65536 bytes"),
        ("", "not a JSON object"),
        ("[1]", "not a JSON object"),
        ("{", "not valid JSON"),
        ('{"pid": 4242', "not valid JSON"),
        ('{"pid": 4242} x', "data after"),
        ('{"pid": "4242"}', "not a process id"),
        ('{"pid": 4242.5}', "not a process id"),
        ('{"pid": -1}', "not a process id"),
        ('{"pid": 0}', "not a process id"),
        ('{"pid": 99999999999}', "not a process id"),
        ('{"pid": 4242, "pid": 4242}', "more than one"),
        ('{"annotations": {"pid": 4242}}', 'no "pid"'),
        ('{"pid": 4242, "a": "\\x"}', "not valid JSON"),
        ('{"pid": 4242, "a": "\x01"}', "not valid JSON"),
        ('{"pid": 4242, "a": ' + "[" * 100 + "]" * 100 + "}", "not valid JSON"),
        (b'{"pid": 4242, "a": "\x00"}', "not valid JSON"),
    ],
)
def test_a_malformed_or_oversized_state_is_refused(
    world: HookWorld, state: str | bytes, says: str
) -> None:
    world.container(PID, LEAF)
    refused(world, state, says)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--gpu", UUID], "usage"),
        (["--limit-mib", "5"], "usage"),
        (["--gpu", UUID, "--limit-mib", "5", "--env", "X"], "usage"),
        (["--gpu", "GPU-../x", "--limit-mib", "5"], "not a GPU UUID"),
        (["--gpu", "MIG-1", "--limit-mib", "5"], "not a GPU UUID"),
        (["--gpu", UUID, "--limit-mib", "0"], "not a positive number"),
        (["--gpu", UUID, "--limit-mib", "-5"], "not a positive number"),
        (["--gpu", UUID, "--limit-mib", "12m"], "not a positive number"),
        (["--gpu", UUID, "--limit-mib", "99999999999999999999"], "not a positive number"),
        (["--gpu", UUID, "--limit-mib", "5", "--cgroup-root", "rel"], "absolute path"),
    ],
)
def test_bad_arguments_are_refused(world: HookWorld, args: list[str], says: str) -> None:
    world.container(PID, LEAF)
    full = [str(world.hook), *args]
    if "--cgroup-root" not in args:
        full += ["--cgroup-root", str(world.cgroup)]
    full += ["--nvml-lib", str(world.nvml), "--proc-root", str(world.proc)]
    refused(world, oci_state(PID), says, args=full)


@pytest.mark.parametrize(
    "mode, says",
    [("unsupported", "Not Supported"), ("broken", "reads back")],
)
def test_a_driver_that_refuses_or_forgets_fails_the_container(
    world: HookWorld, mode: str, says: str
) -> None:
    world.store.publish("615.20.01", {UUID: mode})
    world.container(PID, LEAF)
    result = world.run(oci_state(PID))
    assert result.returncode == 1 and says in result.stderr, result
    assert world.store.limits() == {}


def test_no_such_card_no_driver_no_library(world: HookWorld) -> None:
    world.container(PID, LEAF)
    other = "GPU-99999999-2222-3333-4444-555555555555"
    result = world.run(oci_state(PID), args=world.args(uuid=other))
    assert result.returncode == 1 and f"no GPU {other}" in result.stderr
    result = world.run(oci_state(PID), env={})
    assert result.returncode == 1 and "nvmlInit_v2" in result.stderr
    args = world.args()
    args[args.index("--nvml-lib") + 1] = str(world.base / "missing.so")
    result = world.run(oci_state(PID), args=args)
    assert result.returncode == 1 and "cannot load" in result.stderr
    assert world.store.limits() == {}


def test_the_real_root_must_be_a_cgroup2_file_system(world: HookWorld) -> None:
    world.container(PID, LEAF)
    args = [a for a in world.args() if a not in ("--cgroup-root", str(world.cgroup))]
    result = world.run(oci_state(PID), args=args)
    assert result.returncode == 1
    assert "cgroup" in result.stderr  # not a cgroup2 mount here, or no such path there


JSON_ATOMS = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    extra=st.dictionaries(st.text(max_size=6).filter(lambda k: k != "pid"), JSON_ATOMS, max_size=4)
)
def test_any_json_state_with_the_pid_is_read_alike(
    world: HookWorld, extra: dict[str, object]
) -> None:
    namespace = world.container(PID, LEAF)
    state = {**extra, "pid": PID}
    result = world.run(json.dumps(state, ensure_ascii=False))
    assert result.returncode == 0, (state, result.stderr)
    assert list(world.store.limits()) == [(UUID, namespace)]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(raw=st.binary(max_size=64) | st.text(alphabet='{}[]":,0123456789pid \\', max_size=40))
def test_arbitrary_input_sets_nothing_unless_it_is_a_state(
    world: HookWorld, raw: bytes | str
) -> None:
    world.container(PID, LEAF)
    data = raw.encode() if isinstance(raw, str) else raw
    result = world.run(data)
    if result.returncode == 0:  # then it was JSON with exactly our pid at the top
        assert json.loads(data)["pid"] == PID
    else:
        assert world.store.limits() == {}
    for entry in list(world.store.limits()):
        world.store.set_memory_limits(entry[0], entry[1], 0, (1 << 64) - 1)


# -- a claim share's holder record (--holder; docs/dra.md, "One container at a time")


def holder_args(world: HookWorld, holder: Path) -> list[str]:
    return [*world.args(), "--holder", str(holder)]


def test_a_holder_directory_that_is_a_link_or_shared_is_refused(
    world: HookWorld, tmp_path: Path
) -> None:
    world.container(PID, LEAF)
    real = tmp_path / "real-holder"
    real.mkdir(mode=0o700)
    link = tmp_path / "holder-link"
    link.symlink_to(real)
    result = world.run(oci_state(PID), args=holder_args(world, link))
    assert result.returncode == 1 and "cannot open the claim's holder directory" in result.stderr
    real.chmod(0o777)
    result = world.run(oci_state(PID), args=holder_args(world, real))
    assert result.returncode == 1 and "not the hook's own" in result.stderr
    assert world.store.limits() == {} and list(real.iterdir()) == []


def test_a_fifo_or_a_link_as_the_record_refuses_without_waiting(
    world: HookWorld, tmp_path: Path
) -> None:
    world.container(PID, LEAF)
    holder = tmp_path / "holder"
    holder.mkdir(mode=0o700)
    os.mkfifo(holder / "holder")  # nothing would ever write it: a blocking open hangs
    result = world.run(oci_state(PID), args=holder_args(world, holder))
    assert result.returncode == 1 and "not a file" in result.stderr
    (holder / "holder").unlink()
    (holder / "holder").symlink_to("/etc/hostname")
    result = world.run(oci_state(PID), args=holder_args(world, holder))
    assert result.returncode == 1 and "holder record" in result.stderr
    assert world.store.limits() == {}


@pytest.mark.parametrize("record", [b"", b"/\n", b"../../etc\n", b"/a/../b\n", b"/a\n/b\n"])
def test_a_record_that_names_no_cgroup_is_taken_over(
    world: HookWorld, tmp_path: Path, record: bytes
) -> None:
    namespace = world.container(PID, LEAF)
    holder = tmp_path / "holder"
    holder.mkdir(mode=0o700)
    (holder / "holder").write_bytes(record)
    result = world.run(oci_state(PID), args=holder_args(world, holder))
    assert result.returncode == 0, result.stderr
    assert (holder / "holder").read_text() == f"{LEAF}\n"
    assert world.store.limits() == {(UUID, namespace): MemoryLimits(0, 512 << 20)}
