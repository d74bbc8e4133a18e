"""The node's MPS control daemon (``nvidia-cuda-mps-control``), supervised.

One control daemon per node, started with ``-d`` (and ``-m``, multi-user, so that the
servers it spawns are root's, where the executable offers it), its pipe and log
directories under the daemon's host directory (``<host_lib_dir>/mps/pipe`` and
``.../log``). The daemon daemonizes itself and writes its pid into the pipe directory
(``nvidia-cuda-mps-control.pid``); :class:`MpsControl` watches that pid (a pidfd where
the kernel has one: no polling) and starts it again when it dies, with a doubling
back-off, re-applying every cap it had set. At stop it sends ``quit`` and waits for the
pid to go (SIGTERM, then SIGKILL, if it does not).

Commands are written to the executable's stdin with ``CUDA_MPS_PIPE_DIRECTORY`` in its
environment, as NVIDIA documents (``echo quit | nvidia-cuda-mps-control``). Per
container caps:

* **v3 namespaces** (driver r615+; ``-p 3 -h`` lists ``namespace``): one namespace per
  container, its own pipe directory, capped (active thread percentage, pinned memory)
  BEFORE the container is created; the container mounts only that directory.
* **otherwise** the shared pipe directory and the client environment, which a client can
  only lower, but which the pod's own env can drop: shown as ``soft``.

The v3 command words are in :data:`V3` (one place: they come from NVIDIA's r615 notes in
the brief and have not run against a real driver here; ``docs/choosing.md`` says so).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpushare.host.library import cache_key, prepare_cache_dir

log = structlog.get_logger(__name__)

MPS_DIR_NAME = "mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
#: The v3 control commands (see the module's note).
V3 = {
    "create": "create_namespace {name} {pipe}",
    "threads": "set_namespace_active_thread_percentage {name} {percent}",
    "memory": "set_namespace_device_pinned_mem_limit {name} 0 {mib}M",
    "remove": "remove_namespace {name}",
}
#: How long a command or the daemon's start may take before it counts as failed.
COMMAND_TIMEOUT = 10.0
#: Restart back-off: first delay, the most, and how long a run must last to reset it.
BACKOFF_FIRST, BACKOFF_MAX, BACKOFF_RESET = 1.0, 60.0, 120.0


class MpsError(Exception):
    """The control daemon cannot do what was asked; the message is one line."""


@dataclass(frozen=True)
class Capabilities:
    multi_user: bool  # ``-m``: servers run as root, clients of every uid share them
    namespaces: bool  # v3: per-namespace pipe directories and caps


@dataclass(frozen=True)
class Cap:
    """One container's namespace: its pipe directory and limits."""

    pipe: Path
    percent: int = 100
    memory_mib: int | None = None


def mps_dirs(host_dir: Path) -> tuple[Path, Path]:
    """The control daemon's (pipe, log) directories under the daemon's host directory."""
    root = host_dir / MPS_DIR_NAME
    return root / "pipe", root / "log"


def mps_shm_dir(host_dir: Path) -> Path:
    """The host directory the servers and every client share as ``/dev/shm`` (MPS passes
    work through shared memory: the DaemonSet mounts it at its own ``/dev/shm``)."""
    return host_dir / MPS_DIR_NAME / "shm"


def probe(executable: Path, env: Mapping[str, str] | None = None) -> Capabilities:
    """What ``executable`` offers, from its own help (``-h``; ``-p 3 -h`` for v3)."""

    def help_text(*args: str) -> str:
        try:
            done = subprocess.run(
                [str(executable), *args],
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
                env=dict(env) if env is not None else None,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout + done.stderr if done.returncode == 0 else ""

    usage = help_text("-h")
    v3 = help_text("-p", "3", "-h")
    return Capabilities(
        multi_user=any(w in ("-m", "-m,") for w in usage.split()),
        namespaces="namespace" in v3,
    )


def available(executable: str) -> str | None:
    """Why the control daemon at ``executable`` cannot be used, or None."""
    if not executable:
        return "no mpsControl configured"
    path = Path(executable)
    if not path.is_file():
        return f"mpsControl {executable} does not exist"
    if not os.access(path, os.X_OK):
        return f"mpsControl {executable} is not executable"
    return None


class MpsControl:
    """The supervised control daemon of this node, and each container's cap."""

    def __init__(
        self,
        executable: Path,
        host_dir: Path,
        *,
        backoff: tuple[float, float] = (BACKOFF_FIRST, BACKOFF_MAX),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.executable = executable
        self.pipe_dir, self.log_dir = mps_dirs(host_dir)
        self.backoff = backoff
        self._clock = clock
        self.capabilities = Capabilities(multi_user=False, namespaces=False)
        self.pid: int | None = None
        self.starts = 0  # how many times the control daemon was started
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._caps: dict[str, Cap] = {}  # namespace name -> its cap, re-applied at restart
        self._caps_lock = threading.Lock()

    # ------------------------------------------------------------------ the process
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def start(self) -> None:
        """Start the control daemon (and the watch that restarts it); MpsError if it
        will not start."""
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        shm = self.pipe_dir.parent / "shm"
        shm.mkdir(exist_ok=True)
        os.chmod(shm, 0o1777)  # as /dev/shm: every client uid writes its segments
        os.chmod(self.pipe_dir, 0o755)  # clients of every uid reach the pipes
        os.chmod(self.log_dir, 0o700)
        self.capabilities = probe(self.executable, self.env())
        self._launch()
        log.info(
            "mps_control_started",
            pid=self.pid,
            multi_user=self.capabilities.multi_user,
            namespaces=self.capabilities.namespaces,
            pipe_dir=str(self.pipe_dir),
        )
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="mps-control", daemon=True)
        self._thread.start()

    def _launch(self) -> None:
        pid_file = self.pipe_dir / PID_FILE
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()
        args = [str(self.executable), "-d"]
        if self.capabilities.multi_user:
            args.append("-m")
        try:
            done = subprocess.run(
                args, env=self.env(), capture_output=True, text=True, timeout=COMMAND_TIMEOUT
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"cannot start {self.executable} -d: {exc}") from None
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip().splitlines()
            raise MpsError(
                f"{self.executable} -d exited {done.returncode}: {why[0] if why else ''}".strip()
            )
        pid = self._read_pid(pid_file)
        with self._changed:
            self.pid = pid
            self.starts += 1
            self._changed.notify_all()

    def _read_pid(self, pid_file: Path) -> int:
        """The daemon writes its pid file once it serves: wait for it (bounded)."""
        deadline = self._clock() + COMMAND_TIMEOUT
        while True:
            try:
                text = pid_file.read_text().strip()
                if text.isdigit():
                    return int(text)
            except FileNotFoundError:
                pass
            if self._clock() > deadline:
                raise MpsError(f"{self.executable} -d wrote no pid file in {pid_file.parent}")
            time.sleep(0.01)  # the daemonized process is not ours to wait on

    def alive(self) -> bool:
        pid = self.pid
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _not_zombie(pid)

    def wait_started(self, count: int, timeout: float) -> bool:
        """Wait until the control daemon was started ``count`` times (tests, ops)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.starts >= count, timeout)

    def _watch(self) -> None:
        delay = self.backoff[0]
        while not self._stop.is_set():
            started_at = self._clock()
            self._wait_for_exit()
            if self._stop.is_set():
                return
            log.error("mps_control_died", pid=self.pid, restart_in_s=delay)
            if self._clock() - started_at > BACKOFF_RESET:
                delay = self.backoff[0]
            if self._stop.wait(delay):
                return
            try:
                self._launch()
                self._reapply()
                log.info("mps_control_restarted", pid=self.pid, caps=len(self._caps))
            except MpsError as exc:
                log.error("mps_control_restart_failed", reason=str(exc))
                self.pid = None
            delay = min(delay * 2, self.backoff[1])

    def _wait_for_exit(self) -> None:
        """Return when the control daemon is gone or stop is asked."""
        pid = self.pid
        if pid is None:
            return
        fd = -1
        with contextlib.suppress(OSError, AttributeError):
            fd = os.pidfd_open(pid)
        try:
            while not self._stop.is_set():
                if fd >= 0:
                    ready, _, _ = select.select([fd, self._wake_r], [], [])
                    if fd in ready:
                        return
                elif not self.alive() or self._stop.wait(1.0):
                    return
                if not self.alive():
                    return
        finally:
            if fd >= 0:
                os.close(fd)

    def stop(self) -> None:
        """``quit``, then wait for the pid to go; SIGTERM and SIGKILL if it lingers."""
        self._stop.set()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=COMMAND_TIMEOUT)
        pid = self.pid
        if pid is not None and self.alive():
            with contextlib.suppress(MpsError):
                self.command("quit")
            for sig in (None, signal.SIGTERM, signal.SIGKILL):
                if sig is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                if _gone_within(pid, 2.0):
                    break
        log.info("mps_control_stopped", pid=pid)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------------ commands
    def command(self, line: str) -> str:
        """One control command; its answer. MpsError when it cannot be delivered."""
        if "\n" in line:
            raise MpsError("one command per line")
        try:
            done = subprocess.run(
                [str(self.executable)],
                input=line + "\n",
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"MPS control command {line.split()[0]!r} failed: {exc}") from None
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip().splitlines()
            raise MpsError(
                f"MPS control command {line.split()[0]!r} exited {done.returncode}: "
                f"{why[0] if why else ''}".strip()
            )
        answer = done.stdout.strip()
        if answer.lower().startswith(("error", "invalid", "unknown")):
            raise MpsError(f"MPS control command {line.split()[0]!r}: {answer.splitlines()[0]}")
        return answer

    def cap(self, name: str, cap: Cap) -> None:
        """Create (or re-cap) namespace ``name`` with its own pipe directory: v3 only."""
        if not self.capabilities.namespaces:
            raise MpsError("this MPS control daemon has no namespaces (driver before r615)")
        with self._caps_lock:
            known = self._caps.get(name)
            self._caps[name] = cap
        if known is None or known.pipe != cap.pipe:
            self.command(V3["create"].format(name=name, pipe=cap.pipe))
        self.command(V3["threads"].format(name=name, percent=cap.percent))
        if cap.memory_mib is not None:
            self.command(V3["memory"].format(name=name, mib=cap.memory_mib))
        log.info("mps_namespace_capped", namespace=name, percent=cap.percent, mib=cap.memory_mib)

    def caps(self) -> dict[str, Cap]:
        with self._caps_lock:
            return dict(self._caps)

    def forget(self, name: str) -> None:
        """Remove a namespace whose container is gone."""
        with self._caps_lock:
            known = self._caps.pop(name, None)
        if known is not None:
            with contextlib.suppress(MpsError):
                self.command(V3["remove"].format(name=name))

    def _reapply(self) -> None:
        for name, cap in self.caps().items():
            with self._caps_lock:
                self._caps.pop(name, None)
            self.cap(name, cap)


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != b"Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if not _not_zombie(pid):
            return True
        time.sleep(0.02)
    return False


#: How many core grants may wait for their container's memory answer (the kubelet
#: allocates a container's two resources back to back; older ones are dropped).
PENDING_LIMIT = 256


class MpsGrants:
    """Each device-plugin container's namespace, from its two answers.

    The memory answer makes the namespace (named after the container's memory units, its
    pipe directory a fresh per-container directory that the garbage collector removes
    with the units) and caps it; the core answer caps the namespace of its partner (the
    memory binding of the same container), or, when it comes first, leaves its cap for
    the memory answer that pairs with it. Both run before the container is created.
    Without namespaces nothing is made here: the answers carry the client's own caps.
    """

    def __init__(self, control: MpsControl, host_dir: Path) -> None:
        self.control = control
        self.host_dir = host_dir
        self._pending: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()

    @property
    def namespaces(self) -> bool:
        return self.control.capabilities.namespaces

    def memory(
        self,
        device_ids: list[str],
        memory_mib: int,
        *,
        pinned: bool,
        partner_cores: tuple[str, ...] | None,
    ) -> Path | None:
        """The container's namespace pipe directory (None without namespaces), capped at
        its partner's cores if they came first (else 100 %) and, where ``pinned``, at
        ``memory_mib`` of pinned device memory."""
        if not self.namespaces:
            return None
        percent = 100
        if partner_cores is not None:
            with self._lock:
                percent = self._pending.pop(tuple(sorted(partner_cores)), 100)
        name = cache_key(device_ids)
        if name in self.control.caps():  # an earlier holder's: its pipes go with its dir
            self.control.forget(name)
        pipe = prepare_cache_dir(self.host_dir, device_ids)
        self.control.cap(cache_key(device_ids), Cap(pipe, percent, memory_mib if pinned else None))
        return pipe

    def cores(
        self, device_ids: list[str], cores: int, *, partner_memory: tuple[str, ...] | None
    ) -> None:
        """Cap the container's namespace at ``cores`` percent of the card's threads."""
        if not self.namespaces:
            return
        percent = min(max(cores, 1), 100)
        if partner_memory is not None:
            name = cache_key(partner_memory)
            known = self.control.caps().get(name)
            if known is not None:
                self.control.cap(name, Cap(known.pipe, percent, known.memory_mib))
                return
        with self._lock:
            self._pending[tuple(sorted(device_ids))] = percent
            while len(self._pending) > PENDING_LIMIT:
                self._pending.pop(next(iter(self._pending)))

    def claim(self, key: str, pipe: Path, memory_mib: int, cores: int, *, pinned: bool) -> None:
        """A DRA claim's share: its namespace (named after its cache key), capped at
        ``cores`` (0: not throttled) and, where ``pinned``, ``memory_mib``; made at prepare,
        before any container of the claim exists."""
        if self.namespaces:
            percent = min(cores, 100) if cores > 0 else 100
            self.control.cap(key, Cap(pipe, percent, memory_mib if pinned else None))

    def collect(self) -> list[str]:
        """Forget the namespaces whose pipe directory the garbage collector removed (their
        containers are gone); the names forgotten."""
        gone = [name for name, cap in self.control.caps().items() if not cap.pipe.is_dir()]
        for name in gone:
            self.control.forget(name)
        return gone
