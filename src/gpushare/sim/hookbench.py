"""What the driver memory hook costs a container's creation: the hook
(``hook/memory-hook.c``) run as a container runtime runs it, the OCI state on stdin,
against the stand-in NVML (``tests/kit/standin/libnvml_standin.c``) and its simulated
driver's store, on a stand-in cgroup tree and /proc. Both are built with gcc from the
checkout; where gcc or the sources are missing the figure is not measured (said so).
The figure is process start, the state's parsing, the cgroup walk and the two NVML
calls: the whole of what the runtime waits for (a real driver's calls are not in it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpushare.gpu.memlimits import LimitStore

ROOT = Path(__file__).resolve().parents[3]
HOOK_SOURCE = ROOT / "hook" / "memory-hook.c"
NVML_SOURCE = ROOT / "tests" / "kit" / "standin" / "libnvml_standin.c"
UUID = "GPU-00000000-0000-4000-8000-000000000000"
#: The most a container's creation may wait for the hook, p50 (issue 31).
TARGET_P50_SECONDS = 0.020


@dataclass(frozen=True)
class HookTimes:
    seconds: list[float]  # one per container created
    failures: int


def available() -> str:
    """"" when the hook can be built and run here, else why not."""
    if shutil.which("gcc") is None:
        return "no gcc"
    missing = [str(p) for p in (HOOK_SOURCE, NVML_SOURCE) if not p.exists()]
    return f"missing {', '.join(missing)}" if missing else ""


def measure(containers: int) -> HookTimes:
    """Run the hook once per simulated container, each in a cgroup of its own."""
    with tempfile.TemporaryDirectory(prefix="gpushare-hookbench-") as tmp:
        base = Path(tmp)
        hook, nvml = base / "hook", base / "libnvidia-ml.so.1"
        subprocess.run(["gcc", "-O2", "-o", str(hook), str(HOOK_SOURCE), "-ldl"], check=True,
                       timeout=120)  # fmt: skip
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(nvml), str(NVML_SOURCE)],
                       check=True, timeout=120)  # fmt: skip
        cgroup, proc = base / "cgroup", base / "proc"
        cgroup.mkdir()
        (cgroup / "cgroup.controllers").write_text("memory\n")
        store = LimitStore(base / "store")
        store.publish("615.20.01", {UUID: "ok"})
        env = {"GPUSHARE_NVML_STORE": str(store.path)}
        seconds: list[float] = []
        failures = 0
        for i in range(containers):
            pid = 1000 + i
            leaf = f"/kubepods.slice/pod{i}.slice/cri-containerd-{i:064x}.scope"
            (cgroup / leaf.lstrip("/")).mkdir(parents=True)
            (proc / str(pid)).mkdir(parents=True)
            (proc / str(pid) / "cgroup").write_text(f"0::{leaf}\n")
            state = json.dumps({"ociVersion": "1.2.0", "id": f"c{i}", "status": "creating",
                                "pid": pid, "bundle": f"/run/c{i}"}).encode()  # fmt: skip
            args = [str(hook), "--gpu", UUID, "--limit-mib", "4096", "--nvml-lib", str(nvml),
                    "--cgroup-root", str(cgroup), "--proc-root", str(proc)]  # fmt: skip
            started = time.perf_counter()
            result = subprocess.run(args, input=state, capture_output=True, env=env, timeout=60)
            seconds.append(time.perf_counter() - started)
            failures += result.returncode != 0
        return HookTimes(seconds, failures)
