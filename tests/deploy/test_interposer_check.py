"""The interposer is checked with ``nm -D`` wherever it comes from.

``scripts/check-interposer.sh`` is what the image build runs on the library (published
or built from source); here it runs on stand-in libraries gcc builds in the test: one
exporting the hooks, one exporting only ``dlsym`` (what a Release build of HAMi-core
gives), one whose hooks are hidden. The Dockerfile is checked to run it in both ways of
obtaining the library, to build from a pinned commit with upstream's options, and to
record which library the image carries. With ``GPUSHARE_HAMI_CORE_SRC`` pointing at a
HAMi-core checkout, the source build itself runs (slow marker).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_deploy_manifests import _global_args, _stages

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check-interposer.sh"
BUILD = ROOT / "scripts" / "build-hami-core.sh"
HOOKS = [
    "cuInit",
    "cuGetProcAddress",
    "cuMemAlloc_v2",
    "cuMemAllocManaged",
    "cuMemAllocPitch_v2",
    "cuMemAllocAsync",
    "cuMemCreate",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuLaunchKernel",
    "nvmlDeviceGetMemoryInfo",
]

needs_tools = pytest.mark.skipif(
    shutil.which("gcc") is None or shutil.which("nm") is None, reason="needs gcc and nm"
)


def stand_in(tmp_path: Path, name: str, functions: list[str], flags: tuple[str, ...] = ()) -> Path:
    source = tmp_path / f"{name}.c"
    source.write_text("".join(f"int {f}(void) {{ return 0; }}\n" for f in functions))
    library = tmp_path / f"{name}.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", *flags, "-o", str(library), str(source)],
        check=True,
        timeout=60,
    )
    return library


def check(library: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CHECK), str(library)], capture_output=True, text=True, timeout=60,
        env={"PATH": os.environ["PATH"]},
    )  # fmt: skip


@needs_tools
def test_a_library_exporting_every_hook_passes(tmp_path: Path) -> None:
    result = check(stand_in(tmp_path, "full", [*HOOKS, "dlsym", "cuMemAllocFromPoolAsync"]))
    assert result.returncode == 0, result.stderr
    assert "exports every required hook (12 CUDA/NVML functions)" in result.stdout


@needs_tools
@pytest.mark.parametrize(
    "functions,flags,missing",
    [
        (["dlsym"], (), HOOKS),  # a Release build of HAMi-core: only dlsym
        ([*HOOKS, "dlsym"], ("-fvisibility=hidden",), HOOKS),  # hooks compiled but hidden
        ([h for h in HOOKS if h not in ("cuMemAllocAsync", "cuMemCreate")], (),
         ["cuMemAllocAsync", "cuMemCreate"]),  # an old HAMi-core: the known bypasses
    ],
)  # fmt: skip
def test_a_library_that_would_not_enforce_is_refused_naming_the_missing_hooks(
    tmp_path: Path, functions: list[str], flags: tuple[str, ...], missing: list[str]
) -> None:
    result = check(stand_in(tmp_path, "lib", functions, flags))
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    named = line.split("but not:")[1].split(";")[0].split()
    assert named == list(missing)


@needs_tools
def test_no_file_or_not_a_library_is_refused(tmp_path: Path) -> None:
    assert check(tmp_path / "absent.so").returncode == 1
    text = tmp_path / "text.so"
    text.write_text("not ELF")
    assert check(text).returncode == 1


def test_the_dockerfile_checks_both_ways_and_pins_the_source() -> None:
    args = _global_args()
    assert re.fullmatch(r"[0-9a-f]{40}", args["HAMI_CORE_COMMIT"])
    assert args["INTERPOSER"] == "published"
    stages = {line.split()[-1]: body for line, body in _stages()}
    for way in ("interposer-published", "interposer-source"):
        body = " ".join(stages[way])
        assert "check-interposer.sh /out/libvgpu.so" in body or "build-hami-core.sh" in body
        assert "/out/libvgpu.version" in body
    source = " ".join(stages["interposer-source"])
    assert "archive/${HAMI_CORE_COMMIT}.tar.gz" in source
    assert "nvidia-cuda-runtime-cu12==" in source and "nvidia-nvml-dev-cu12==" in source
    # the build script ends with the check: a source build cannot skip it
    assert BUILD.read_text().rstrip().endswith('"$here/check-interposer.sh" "$out"')
    for option in ("DLSYM_HOOK_ENABLE", "MULTIPROCESS_LIMIT_ENABLE", "HOOK_MEMINFO_ENABLE",
                   "HOOK_NVML_ENABLE", "CMAKE_BUILD_TYPE=Debug"):  # fmt: skip
        assert f"-D{option}" in BUILD.read_text()
    final = _stages()[-1][1]
    assert any("/opt/gpushare/lib/libvgpu.version" in line for line in final)
    labels = " ".join(line for line in final if line.startswith("LABEL"))
    assert "io.gpushare.interposer" in labels and "io.gpushare.hami-core-commit" in labels


SOURCE = os.environ.get("GPUSHARE_HAMI_CORE_SRC", "")


@pytest.mark.slow
@pytest.mark.skipif(not SOURCE, reason="set GPUSHARE_HAMI_CORE_SRC to a HAMi-core checkout")
@needs_tools
def test_hami_core_builds_from_source_and_exports_its_hooks(tmp_path: Path) -> None:
    out = tmp_path / "libvgpu.so"
    result = subprocess.run([str(BUILD), SOURCE, str(out)], capture_output=True, text=True,
                            timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert check(out).returncode == 0
