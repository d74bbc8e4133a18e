"""`make image`'s choices, decided without building (scripts/build_image.py).

The builder is one whose engine works (a docker client without an engine is not one);
each offline stand-in replaces a published source only where its host cannot be reached
(or always, with ``--standins all``, as CI builds), and every stand-in is a build argument
the Dockerfile declares, naming a stage it has. Checked over every combination of
builders, reachable hosts, interposers and modes. The build itself runs in the e2e suite
(tests/e2e/test_image.py).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from kit.scripts import build_image
from test_deploy_manifests import _dockerfile, _stages

ROOT = Path(__file__).resolve().parents[2]

HOSTS = ("docker.io", "quay.io", "github.com")
EVERYWHERE = frozenset(HOSTS)


def facts(engines=("docker",), buildx=True, reachable=EVERYWHERE, machine="x86_64"):  # type: ignore[no-untyped-def]
    return build_image.Facts(tuple(engines), buildx, frozenset(reachable), machine)


def request(**kw):  # type: ignore[no-untyped-def]
    return build_image.Request(image="gpushare:0.1.0", version="0.1.0", **kw)


def _declared_args() -> set[str]:
    return {m[1] for line in _dockerfile() if (m := re.match(r"ARG (\w+)", line))}


def _stage_names() -> set[str]:
    return {line.split()[-1] for line, _ in _stages() if len(line.split()) == 4}


def test_where_everything_is_reachable_a_user_gets_the_published_bases() -> None:
    p = build_image.plan(facts(), request())
    assert p.standins == () and not p.local_base
    assert p.multi_arch and p.platforms == "linux/amd64,linux/arm64"
    assert p.build_args["INTERPOSER"] == "published"
    assert "PYTHON_IMAGE" not in p.build_args and "HOOK_BUILDER" not in p.build_args
    command = build_image.build_command(p, request(), "dist/x.oci.tar")
    assert command[:3] == ["docker", "buildx", "build"]


def test_offline_every_source_is_replaced_by_its_stand_in() -> None:
    p = build_image.plan(facts(engines=("buildah",), reachable=()), request())
    assert p.builder == "buildah" and p.platforms == "linux/amd64" and not p.multi_arch
    assert p.build_args["PYTHON_IMAGE"] == build_image.LOCAL_BASE and p.local_base
    assert p.build_args["INTERPOSER"] == "stub"
    assert p.build_args["HOOK_BUILDER"] == "base"
    assert p.build_args["TARGETARCH"] == "amd64"
    command = build_image.build_command(p, request(), "")
    assert command[:2] == ["buildah", "bud"]
    # warm rebuilds reuse layers; the local base is never looked for in a registry
    assert "--layers" in command and "--pull=never" in command
    assert "--build-arg=PYTHON_IMAGE=" + build_image.LOCAL_BASE in command


def test_hami_core_from_source_stands_in_for_the_published_image_where_github_answers() -> None:
    p = build_image.plan(facts(reachable={"github.com", "quay.io"}), request())
    assert p.build_args["INTERPOSER"] == "source"
    assert "HOOK_BUILDER" not in p.build_args and not p.multi_arch  # a stand-in: one platform
    asked = build_image.plan(
        facts(reachable={"docker.io", "quay.io"}), request(interposer="source")
    )
    assert asked.build_args["INTERPOSER"] == "stub"
    assert asked.standins == (
        ("INTERPOSER=stub", "HAMi-core's source: github.com cannot be reached"),
    )


def test_ci_builds_every_stand_in_even_where_a_registry_answers() -> None:
    p = build_image.plan(facts(), request(standins="all"))
    assert {s.split("=")[0] for s, _ in p.standins} == {
        "PYTHON_IMAGE",
        "INTERPOSER",
        "HOOK_BUILDER",
    }
    assert p.build_args["INTERPOSER"] == "stub"


def test_no_stand_ins_means_none_whatever_is_reachable() -> None:
    p = build_image.plan(facts(engines=("podman",), reachable=()), request(standins="none"))
    assert p.standins == () and p.build_args["INTERPOSER"] == "published"
    assert "--pull=never" not in build_image.build_command(p, request(), "")


def test_an_image_with_stand_ins_is_never_pushed() -> None:
    with pytest.raises(build_image.PlanError, match="never pushed"):
        build_image.plan(facts(reachable=()), request(push=True))


def test_no_builder_or_an_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(build_image.PlanError, match="apt-get install buildah"):
        build_image.plan(facts(engines=()), request())
    with pytest.raises(build_image.PlanError, match="riscv64"):
        build_image.plan(facts(machine="riscv64"), request())
    assert (
        build_image.plan(facts(machine="aarch64", buildx=False), request()).platforms
        == "linux/arm64"
    )


@pytest.mark.parametrize("interposer", build_image.INTERPOSERS)
@pytest.mark.parametrize("mode", build_image.STANDIN_MODES)
def test_every_plan_is_a_build_the_dockerfile_can_do(interposer: str, mode: str) -> None:
    """Exhaustive over builders and reachable hosts: stand-ins only for what is out of
    reach (auto), each a declared build argument naming an existing stage."""
    declared, stages = _declared_args(), _stage_names()
    builders = [c for n in range(1, 4) for c in itertools.combinations(build_image.ENGINES, n)]
    for engines, buildx, n in itertools.product(builders, (False, True), range(4)):
        for reachable in itertools.combinations(HOSTS, n):
            p = build_image.plan(
                facts(engines, buildx, reachable), request(interposer=interposer, standins=mode)
            )
            assert set(p.build_args) <= declared
            assert f"interposer-{p.build_args['INTERPOSER']}" in stages
            assert f"hook-builder-{p.build_args.get('HOOK_BUILDER', 'manylinux')}" in stages
            assert p.builder == engines[0]
            replaced = {s.split("=")[0] for s, _ in p.standins}
            if mode == "none" or (mode == "auto" and set(reachable) == EVERYWHERE):
                assert not replaced and p.build_args["INTERPOSER"] == interposer
            if mode == "auto":
                assert ("PYTHON_IMAGE" in replaced) == ("docker.io" not in reachable)
                assert ("HOOK_BUILDER" in replaced) == ("quay.io" not in reachable)
            if p.build_args["INTERPOSER"] == "stub" and interposer != "stub":
                assert mode == "all" or "github.com" not in reachable
            assert p.multi_arch == (engines[0] == "docker" and buildx and not p.standins)


def _executable(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_docker_client_without_an_engine_is_not_a_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`docker --version` answers where no engine runs: `docker info` decides."""
    _executable(tmp_path / "docker", 'case "$1" in --version) echo Docker 28;; *) exit 1;; esac')
    _executable(tmp_path / "podman", "exit 1")  # installed, broken
    _executable(tmp_path / "buildah", '[ "$1" = info ]')
    monkeypatch.setenv("PATH", str(tmp_path))
    found = build_image.gather({"GPUSHARE_IMAGE_OFFLINE": "1"})
    assert found.engines == ("buildah",) and not found.buildx and found.reachable == frozenset()
    _executable(tmp_path / "docker", "exit 0")  # an engine answers: docker first again
    assert build_image.gather({"GPUSHARE_IMAGE_OFFLINE": "1"}).engines == ("docker", "buildah")


def test_the_plan_command_names_builder_and_stand_ins(tmp_path: Path) -> None:
    _executable(tmp_path / "buildah", '[ "$1" = info ]')
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin", "GPUSHARE_IMAGE_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_image.py"), "plan"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        lines[0] == f"builder: buildah, platforms: linux/{build_image.ARCHES[os.uname().machine]}"
    )
    assert [line.split()[1] for line in lines if line.startswith("stand-in:")] == [
        f"PYTHON_IMAGE={build_image.LOCAL_BASE}",
        "INTERPOSER=stub",
        "HOOK_BUILDER=base",
    ]


def test_the_dockerfile_builds_the_stub_and_states_the_hooks_glibc() -> None:
    stages = {line.split()[-1]: " ".join(body) for line, body in _stages()}
    stub = stages["interposer-stub"]
    assert "hook/libvgpu-stub.c" in stub and "check-interposer.sh /out/libvgpu.so" in stub
    assert 'echo "stub ' in stub and "ENFORCES NOTHING" in stub
    hook = stages["memory-hook"]
    assert "objdump -T" in hook and "/out/gpushare-memory-hook.version" in hook
    final = " ".join(_stages()[-1][1])
    assert "/opt/gpushare/lib/gpushare-memory-hook.version" in final
    assert "io.gpushare.memory-hook-builder" in final


@pytest.mark.skipif(
    shutil.which("gcc") is None or shutil.which("nm") is None, reason="needs gcc and nm"
)
def test_the_stub_passes_the_hook_check_fails_closed_and_says_what_it_is(tmp_path: Path) -> None:
    library = tmp_path / "libvgpu.so"
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O2",
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
            str(library),
            str(ROOT / "hook" / "libvgpu-stub.c"),
        ],
        check=True,
        timeout=60,
    )
    result = subprocess.run(
        [str(ROOT / "scripts" / "check-interposer.sh"), str(library)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert b"enforces nothing" in library.read_bytes()
    import ctypes

    stub = ctypes.CDLL(str(library))
    assert stub.cuInit(0) == 801  # CUDA_ERROR_NOT_SUPPORTED: a CUDA program stops here
    assert stub.cuMemAlloc_v2(None, 1 << 20) == 801
    assert stub.nvmlDeviceGetMemoryInfo(None, None) == 3  # NVML_ERROR_NOT_SUPPORTED
