"""Tenants under one backend: what each process's environment, cgroup and limits are,
as gpushare's Allocate answers and hooks would make them for a container.

* ``none`` (a dedicated card) and ``time-sliced``: the card named, nothing limited.
* ``interposer``: ``LD_PRELOAD`` of HAMi-core's ``libvgpu.so`` with the memory limit,
  the SM limit and an accounting file of the tenant's own (one container each);
  ``interposer-memory`` the same with the SM limiter off.
* ``mps`` / ``driver+mps``: a control daemon started here through gpushare's own
  :class:`~gpushare.host.mps.MpsControl` (pipe and log directories under the scratch
  directory) and stopped at the end; each tenant in its own v3 namespace capped at its
  share where the driver has namespaces, else the caps in the client's env.
* ``driver`` / ``driver+mps``: each tenant in a cgroup of its own under a scratch parent
  (``/sys/fs/cgroup/gpushare-bench-<pid>``), its hard limit set by gpushare's memory
  hook (``hook/memory-hook.c``, run as the runtime runs a ``createRuntime`` hook: the OCI
  state with the tenant's pid on stdin) before the tenant calls ``cuInit``.

Nothing here touches a GPU setting. What it changes it undoes on exit: the MPS daemon
is stopped, the scratch cgroups removed, and a ``+dmem`` it had to enable at the cgroup
root disabled again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import gpushare
from gpushare.bench.gpu.plan import Backend
from gpushare.host.mps import Cap, MpsControl, MpsError

CGROUP_ROOT = Path("/sys/fs/cgroup")
HOOK_TIMEOUT = 30.0


class TenancyError(Exception):
    """The backend cannot be set up here (the report says why)."""


@dataclass(frozen=True)
class Context:
    """What every tenancy needs: the card, the share, the programs, a scratch directory."""

    uuid: str
    share: int  # percent of memory and compute
    share_mib: int
    scratch: Path
    interposer: str = ""
    hook: str = ""
    limits_backend: str = ""  # "dmem" or "misc"
    mps_control: str = ""
    python: str = sys.executable
    cgroup_root: Path = CGROUP_ROOT  # where cgroup v2 is mounted


@dataclass
class Running:
    """A tenant process, spawned; ``hook_seconds`` its memory hook's run, if it had one.
    Its output (stdout and stderr: an interposer logs too) is read line by line by a
    thread of its own from the start, so that nothing waits on a pipe's buffering."""

    name: str
    role: str
    proc: subprocess.Popen[str]
    hook_seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue[str | None] = field(default_factory=queue.Queue)
    _reader: threading.Thread | None = None

    def read(self) -> None:
        self._reader = threading.Thread(target=self._pump, name=f"out-{self.name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(self.lines[-1])
        self._queue.put(None)

    def wait_ready(self, deadline: float) -> bool:
        """True once the tenant printed ``ready``; False when it ended first, or did not
        say it by ``deadline`` (then it is killed, and a note says so)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.proc.kill()
                self.notes.append("no ready line in time")
                return False
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                return False
            if line.strip() == "ready":
                return True

    def finish(self, deadline: float) -> list[str]:
        """Every line it printed, once it ended (killed at ``deadline``, with a note)."""
        try:
            self.proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.notes.append("killed: did not finish in time")
        if self._reader is not None:
            self._reader.join(timeout=10.0)
        return list(self.lines)


def worker_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a worker: this one's, gpushare importable, ``extra`` on top."""
    src = str(Path(gpushare.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


class Tenancy:
    """Plain tenants (a dedicated card, time-slicing): the card named, nothing limited.
    The backends below add their limits; :meth:`spawn_many` starts processes at once."""

    gated = False  # whether a tenant waits for its limits before cuInit

    def __init__(self, backend: Backend | None, context: Context) -> None:
        self.backend = backend
        self.context = context
        self.notes: list[str] = []

    def __enter__(self) -> Tenancy:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def env(self, name: str) -> dict[str, str]:
        return {"NVIDIA_VISIBLE_DEVICES": self.context.uuid}

    def admit(self, running: Running) -> None:
        """Put the spawned (gated) tenant under its limits and release it."""

    def release(self, name: str) -> None:
        """The tenant ``name`` has exited: drop what was made for it."""

    def spawn_many(self, names: Sequence[tuple[str, str]], args: Sequence[str]) -> list[Running]:
        """Start one worker per (name, role) as close to at once as a loop gets, each with
        ``--t0`` its own spawn time; gated tenants are admitted in parallel."""
        started = []
        for name, role in names:
            extra = ["--gate"] if self.gated else []
            env = worker_env(self.env(name))  # an MPS namespace is made here, before t0
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [self.context.python, "-m", "gpushare.bench.gpu.worker", *args, *extra,
                 "--t0", repr(t0)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, env=env,
            )  # fmt: skip
            started.append(Running(name, role, proc))
            started[-1].read()
        if self.gated:
            with ThreadPoolExecutor(max_workers=max(len(started), 1)) as pool:
                list(pool.map(self._admit_or_stop, started))
        return started

    def _admit_or_stop(self, running: Running) -> None:
        try:
            self.admit(running)
        except (TenancyError, OSError) as exc:  # OSError: it died before its release
            running.notes.append(f"not admitted: {exc}")
            running.proc.kill()


class Interposer(Tenancy):
    def env(self, name: str) -> dict[str, str]:
        c = self.context
        return {
            **super().env(name),
            "LD_PRELOAD": c.interposer,
            "CUDA_DEVICE_MEMORY_LIMIT_0": f"{c.share_mib}m",
            "CUDA_DEVICE_SM_LIMIT": str(c.share),
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(c.scratch / f"{name}.vgpu.cache"),
        }


class InterposerMemory(Interposer):
    """HAMi-core's memory limit alone: its SM limiter off, compute time-sliced."""

    def env(self, name: str) -> dict[str, str]:
        return {**super().env(name), "CUDA_DEVICE_SM_LIMIT": "0",
                "GPU_CORE_UTILIZATION_POLICY": "disable"}  # fmt: skip


class DriverLimits(Tenancy):
    """A cgroup per tenant, its hard limit set by the memory hook before ``cuInit``."""

    gated = True

    def __init__(self, backend: Backend | None, context: Context) -> None:
        super().__init__(backend, context)
        self.root = context.cgroup_root
        self.parent = self.root / f"gpushare-bench-{os.getpid()}"
        self._enabled_dmem_at_root = False

    def __enter__(self) -> DriverLimits:
        super().__enter__()
        if not self.context.hook:
            raise TenancyError("no memory hook program")
        try:
            if self.context.limits_backend == "dmem":
                self._enable_dmem(self.root, at_root=True)
            self.parent.mkdir()
            if self.context.limits_backend == "dmem":
                self._enable_dmem(self.parent, at_root=False)
        except OSError as exc:
            self.__exit__()
            raise TenancyError(f"cannot make the scratch cgroup {self.parent}: {exc}") from None
        return self

    def _enable_dmem(self, cgroup: Path, *, at_root: bool) -> None:
        """Leaves get ``dmem.*`` files only where their parent enabled the controller."""
        control = cgroup / "cgroup.subtree_control"
        with contextlib.suppress(FileNotFoundError):  # then nothing is enabled; the write says
            if "dmem" in control.read_text().split():
                return
        control.write_text("+dmem")
        if at_root:
            self._enabled_dmem_at_root = True
            self.notes.append(f"enabled +dmem in {control} (disabled again at the end)")

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            for leaf in self.parent.iterdir():
                if leaf.is_dir():
                    _rmdir_when_empty(leaf)
            _rmdir_when_empty(self.parent)
        if self._enabled_dmem_at_root:
            try:
                (self.root / "cgroup.subtree_control").write_text("-dmem")
            except OSError as why:
                self.notes.append(f"could not disable +dmem at the root again: {why}")

    def admit(self, running: Running) -> None:
        leaf = self.parent / running.name
        try:
            leaf.mkdir()
            (leaf / "cgroup.procs").write_text(str(running.proc.pid))
        except OSError as exc:
            raise TenancyError(f"cannot put {running.name} in {leaf}: {exc}") from None
        state = json.dumps({"ociVersion": "1.2.0", "id": running.name, "status": "creating",
                            "pid": running.proc.pid, "bundle": "/"})  # fmt: skip
        began = time.monotonic()
        try:
            done = subprocess.run(
                [self.context.hook, "--gpu", self.context.uuid, "--limit-mib",
                 str(self.context.share_mib)],
                input=state, capture_output=True, text=True, timeout=HOOK_TIMEOUT,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TenancyError(f"memory hook: {exc}") from None
        running.hook_seconds = time.monotonic() - began
        if done.returncode != 0:
            raise TenancyError(f"memory hook exit {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()[:300]}")  # fmt: skip
        assert running.proc.stdin is not None
        running.proc.stdin.write("\n")
        running.proc.stdin.flush()

    def release(self, name: str) -> None:
        _rmdir_when_empty(self.parent / name)


class Mps(Tenancy):
    """An MPS control daemon for this backend's tenants; where ``memory_in_mps`` the
    pinned memory limit too (``mps``; under ``driver+mps`` the driver holds memory)."""

    memory_in_mps = True

    def __init__(self, backend: Backend | None, context: Context) -> None:
        super().__init__(backend, context)
        self.control = MpsControl(Path(context.mps_control), context.scratch / "mps-host")
        self._namespaces: set[str] = set()

    def __enter__(self) -> Mps:
        super().__enter__()
        began = time.monotonic()
        try:
            self.control.start()
        except MpsError as exc:
            raise TenancyError(f"MPS control daemon: {exc}") from None
        self.notes.append(f"MPS control daemon started in {time.monotonic() - began:.2f} s "
                          f"({self.control.capabilities})")  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        began = time.monotonic()
        self.control.stop()
        self.notes.append(f"MPS control daemon stopped in {time.monotonic() - began:.2f} s; "
                          f"alive after stop: {self.control.alive()}")  # fmt: skip

    def env(self, name: str) -> dict[str, str]:
        c = self.context
        env = {**super().env(name), **_mps_dirs(self.control)}
        if self.control.capabilities.namespaces:
            marker = c.scratch / "mps-markers" / name
            marker.mkdir(parents=True, exist_ok=True)
            memory = c.share_mib if self.memory_in_mps else None
            try:
                pipe = self.control.cap(name, Cap(marker, c.share, memory))
                self._namespaces.add(name)
                return {**env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
            except MpsError as exc:  # the v3 spellings are unverified: say so, use env caps
                self.notes.append(f"v3 namespace for {name} failed ({exc}); env caps used")
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(c.share)
        if self.memory_in_mps:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={c.share_mib}M"
        return env

    def release(self, name: str) -> None:
        if name in self._namespaces:
            self._namespaces.discard(name)
            self.control.forget(name)


class DriverMps(Mps):
    """MPS's compute share and the driver's memory limit (the driver-native setting)."""

    memory_in_mps = False
    gated = True

    def __init__(self, backend: Backend | None, context: Context) -> None:
        super().__init__(backend, context)
        self.limits = DriverLimits(backend, context)

    def __enter__(self) -> DriverMps:
        self.limits.__enter__()
        try:
            super().__enter__()
        except TenancyError:
            self.limits.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__()
        self.limits.__exit__()
        self.notes += self.limits.notes

    def admit(self, running: Running) -> None:
        self.limits.admit(running)

    def release(self, name: str) -> None:
        super().release(name)
        self.limits.release(name)


def _mps_dirs(control: MpsControl) -> dict[str, str]:
    return {k: v for k, v in control.env().items() if k.startswith("CUDA_MPS_")}


def _rmdir_when_empty(cgroup: Path, attempts: int = 50) -> None:
    """A cgroup can be removed once its last process is reaped (until then: EBUSY): a
    few tries; any other refusal is final."""
    for _ in range(attempts):
        try:
            cgroup.rmdir()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                return
            time.sleep(0.02)


KINDS: dict[str, type[Tenancy]] = {
    "none": Tenancy,
    "time-sliced": Tenancy,
    "interposer": Interposer,
    "interposer-memory": InterposerMemory,
    "mps": Mps,
    "driver": DriverLimits,
    "driver+mps": DriverMps,
}


@contextlib.contextmanager
def tenancy(backend: Backend | None, context: Context) -> Iterator[Tenancy]:
    """The backend's tenancy, set up and (whatever happens) undone."""
    kind = KINDS[backend.name if backend else "none"]
    with kind(backend, context) as made:
        yield made
