"""The memory hook, the stand-in NVML and the stand-in CUDA driver built by gcc, and a
world for the hook: a stand-in
cgroup v2 tree, a stand-in /proc and the simulated driver's limit store. Shared by the
hook's tests, the end-to-end tests from Allocate or prepare to the limit, and the bench."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpushare.gpu.memlimits import LimitStore

ROOT = Path(__file__).resolve().parents[2]
HOOK_SOURCE = ROOT / "hook" / "memory-hook.c"
NVML_SOURCE = ROOT / "tests" / "kit" / "standin" / "libnvml_standin.c"
CUDA_SOURCE = ROOT / "tests" / "kit" / "standin" / "libcuda_standin.c"
UUID = "GPU-11111111-2222-3333-4444-555555555555"
HAVE_GCC = shutil.which("gcc") is not None


def build(out: Path) -> tuple[Path, Path]:
    """(the hook program, the stand-in libnvidia-ml) built into ``out``."""
    hook, nvml = out / "gpushare-memory-hook", out / "libnvidia-ml.so.1"
    flags = ["-O2", "-Wall", "-Wextra", "-Werror"]
    subprocess.run(["gcc", *flags, "-o", str(hook), str(HOOK_SOURCE), "-ldl"], check=True,
                   timeout=120)  # fmt: skip
    subprocess.run(["gcc", *flags, "-shared", "-fPIC", "-o", str(nvml), str(NVML_SOURCE)],
                   check=True, timeout=120)  # fmt: skip
    return hook, nvml


def build_cuda(lib: Path) -> Path:
    """The stand-in CUDA driver (``libcuda_standin.c``) built as the shared library ``lib``
    (named as the test needs it: ``libcuda.so.1``, or as the interposer)."""
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(CUDA_SOURCE)], check=True,
                   timeout=120)  # fmt: skip
    return lib


@dataclass
class HookWorld:
    """A stand-in host for the hook: ``cgroup`` (a cgroup v2 root), ``proc`` and the
    simulated driver's ``store``."""

    base: Path
    hook: Path
    nvml: Path

    def __post_init__(self) -> None:
        self.cgroup = self.base / "cgroup"
        self.proc = self.base / "proc"
        self.store = LimitStore(self.base / "store")
        self.cgroup.mkdir(parents=True, exist_ok=True)
        (self.cgroup / "cgroup.controllers").write_text("cpu memory\n")
        self.proc.mkdir(exist_ok=True)
        self.store.publish("615.20.01", {UUID: "ok"})

    def container(self, pid: int, path: str, make: bool = True, text: str | None = None) -> str:
        """A process ``pid`` in cgroup ``path`` (made under the root with ``make``);
        ``text``: the whole /proc/<pid>/cgroup instead. The namespace NVML is given."""
        if make:
            (self.cgroup / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (self.proc / str(pid)).mkdir(exist_ok=True)
        (self.proc / str(pid) / "cgroup").write_text(text if text is not None else f"0::{path}\n")
        return f"{self.cgroup}{path}"

    def args(self, uuid: str = UUID, limit_mib: int | str = 512) -> list[str]:
        return [
            str(self.hook), "--gpu", uuid, "--limit-mib", str(limit_mib),
            "--nvml-lib", str(self.nvml), "--cgroup-root", str(self.cgroup),
            "--proc-root", str(self.proc),
        ]  # fmt: skip

    def run(
        self, state: bytes | str | dict[str, object], args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """The hook run as a runtime runs it: the OCI state on stdin."""
        data = json.dumps(state) if isinstance(state, dict) else state
        raw = data.encode() if isinstance(data, str) else data
        result = subprocess.run(
            args if args is not None else self.args(),
            input=raw,
            capture_output=True,
            env={"GPUSHARE_NVML_STORE": str(self.store.path)} if env is None else env,
            timeout=60,
        )
        return subprocess.CompletedProcess(
            result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
        )


def oci_state(pid: int, **extra: object) -> dict[str, object]:
    return {"ociVersion": "1.2.0", "id": "c1", "status": "creating", "pid": pid,
            "bundle": "/run/containerd/c1", **extra}  # fmt: skip


def tree(base: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``base`` with its size and change time: what a run wrote."""
    found = {}
    for here, dirs, files in os.walk(base):
        for name in dirs + files:
            path = Path(here) / name
            st = path.lstat()
            found[str(path.relative_to(base))] = (st.st_size, st.st_mtime_ns)
    return found


def run_check(
    hook: Path, bundle: Path, env: list[str] | None, args: list[str], config: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    """The hook's ``--check-limits`` mode run as a runtime runs a createRuntime hook: the
    OCI state naming ``bundle`` on stdin, whose ``config.json`` holds ``env`` as its
    ``process.env`` (or ``config``, the whole file, as given)."""
    bundle.mkdir(parents=True, exist_ok=True)
    if config is None:
        config = json.dumps({"ociVersion": "1.2.0", "process": {"env": env}}).encode()
    target = bundle / "config.json"
    if target.is_symlink() or target.exists():
        target.unlink()
    target.write_bytes(config)
    state = json.dumps(oci_state(4242, bundle=str(bundle))).encode()
    result = subprocess.run(
        [str(hook), "--check-limits", *args], input=state, capture_output=True, env={},
        timeout=60,
    )  # fmt: skip
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


_SHARED: list[Path] = []


def shared_hook() -> Path:
    """The hook program for daemons under test to install (``--memory-hook``): built once
    per test process with gcc, or, without gcc, a placeholder file (installed and named in
    specs like the real one; the tests that run it skip without gcc)."""
    if not _SHARED:
        out = Path(tempfile.mkdtemp(prefix="gs-hook-"))
        if HAVE_GCC:
            hook, _nvml = build(out)
        else:
            hook = out / "gpushare-memory-hook"
            hook.write_bytes(
                b"#!/bin/sh\necho 'gpushare-memory-hook: not built (no gcc)' >&2\nexit 1\n"
            )
            hook.chmod(0o755)
        _SHARED.append(hook)
    return _SHARED[0]
