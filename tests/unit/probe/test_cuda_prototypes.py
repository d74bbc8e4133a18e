"""The probe's ctypes prototypes match the CUDA and NVML headers, no GPU needed.

``cuda.h`` comes from the ``nvidia-cuda-runtime-cu12`` wheel and ``nvml.h`` from
``nvidia-nvml-dev-cu12`` (the test extra). gcc compiles, against them, a pointer of the
exact function type for every prototype of :data:`gpushare.probe.cuda.PROTOTYPES`
(``-Werror`` turns a mismatch into a failure), a static assertion of every C type's size
against its ctypes type, and every structure's size and field offsets.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pynvml
import pytest

from gpushare.probe import cuda


def _include(package: str) -> Path | None:
    try:
        module = __import__(f"nvidia.{package}", fromlist=["_"])
    except ImportError:
        return None
    for root in module.__path__:
        if (Path(root) / "include").is_dir():
            return Path(root) / "include"
    return None


CUDA_INCLUDE = _include("cuda_runtime")
NVML_INCLUDE = _include("nvml_dev")
needs = pytest.mark.skipif(
    shutil.which("gcc") is None or CUDA_INCLUDE is None or NVML_INCLUDE is None,
    reason="needs gcc and the nvidia-cuda-runtime-cu12 / nvidia-nvml-dev-cu12 wheels",
)


def c_checks() -> str:
    lines = ["#include <stddef.h>", "#include <cuda.h>", "#include <nvml.h>"]
    for name, (restype, argtypes) in cuda.PROTOTYPES.items():
        args = ", ".join(argtypes) or "void"
        lines.append(f"typedef {restype} (*t_{name})({args});")
        lines.append(f"t_{name} p_{name} = &{name};")
    for ctype, pytype in cuda.C_TYPES.items():
        size = ctypes.sizeof(pytype)
        lines.append(f'_Static_assert(sizeof({ctype}) == {size}, "size of {ctype}");')
    for cname, struct in cuda.STRUCTS.items():
        lines.append(f'_Static_assert(sizeof({cname}) == {ctypes.sizeof(struct)}, "{cname}");')
        for field, *_ in struct._fields_:
            offset = getattr(struct, field).offset
            lines.append(
                f'_Static_assert(offsetof({cname}, {field}) == {offset}, "{cname}.{field}");'
            )
    # NVML through pynvml: the call the probe makes and the structure it reads
    lines.append("typedef nvmlReturn_t (*t_mem)(nvmlDevice_t, nvmlMemory_t *);")
    lines.append("t_mem p_mem = &nvmlDeviceGetMemoryInfo;")
    memory = pynvml.c_nvmlMemory_t
    lines.append(f'_Static_assert(sizeof(nvmlMemory_t) == {ctypes.sizeof(memory)}, "mem");')
    for field, *_ in memory._fields_:
        offset = getattr(memory, field).offset
        lines.append(f'_Static_assert(offsetof(nvmlMemory_t, {field}) == {offset}, "{field}");')
    return "\n".join(lines) + "\n"


@needs
def test_every_prototype_and_structure_matches_the_headers(tmp_path: Path) -> None:
    source = tmp_path / "check.c"
    source.write_text(c_checks())
    result = subprocess.run(
        ["gcc", "-std=c11", "-c", "-Werror", "-Wall", "-Wno-unused-variable",
         f"-I{CUDA_INCLUDE}", f"-I{NVML_INCLUDE}", "-o", str(tmp_path / "check.o"),
         str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


@needs
def test_a_wrong_prototype_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself bites: cuMemAlloc_v2 with a 32-bit size fails to compile."""
    wrong = dict(cuda.PROTOTYPES, cuMemAlloc_v2=("CUresult", ("CUdeviceptr *", "unsigned int")))
    monkeypatch.setattr(cuda, "PROTOTYPES", wrong)
    source = tmp_path / "check.c"
    source.write_text(c_checks())
    result = subprocess.run(
        ["gcc", "-std=c11", "-c", "-Werror", f"-I{CUDA_INCLUDE}", f"-I{NVML_INCLUDE}",
         "-o", str(tmp_path / "check.o"), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and "cuMemAlloc_v2" in result.stderr


def test_every_c_type_of_a_prototype_has_a_ctypes_type() -> None:
    for restype, argtypes in cuda.PROTOTYPES.values():
        for ctype in (restype, *argtypes):
            assert ctype in cuda.C_TYPES, ctype


def test_the_kernel_is_nul_terminated_ptx_with_its_entry() -> None:
    assert cuda.SPIN_PTX.endswith(b"\x00") and b".entry spin(" in cuda.SPIN_PTX


def _ptxas() -> str | None:
    """ptxas from the nvidia-cuda-nvcc-cu12 wheel if installed, else on the PATH."""
    try:
        import nvidia.cuda_nvcc as nvcc  # type: ignore[import-not-found]
    except ImportError:
        return shutil.which("ptxas")
    for root in nvcc.__path__:
        candidate = Path(root) / "bin" / "ptxas"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("ptxas")


PTXAS = _ptxas()


@pytest.mark.skipif(PTXAS is None, reason="no ptxas (pip install nvidia-cuda-nvcc-cu12)")
@pytest.mark.parametrize("arch", ["sm_50", "sm_80", "sm_90"])
def test_the_kernel_assembles_for_old_and_new_cards(arch: str, tmp_path: Path) -> None:
    """The probe's hand-written PTX is valid: ptxas (no GPU needed) assembles it."""
    assert PTXAS is not None
    source = tmp_path / "spin.ptx"
    source.write_bytes(cuda.SPIN_PTX.rstrip(b"\x00"))
    result = subprocess.run(
        [PTXAS, f"-arch={arch}", str(source), "-o", str(tmp_path / "spin.cubin")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
