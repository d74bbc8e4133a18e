"""The node's MPS control daemon (``nvidia-cuda-mps-control``), supervised.

One control daemon per node, started with ``-d`` (and ``-M``, multi-user, so that the
servers it spawns are root's, where the executable offers it), its pipe and log
directories under the daemon's host directory (``<host_lib_dir>/mps/pipe`` and
``.../log``). The daemon daemonizes itself and writes its pid into the pipe directory
(``nvidia-cuda-mps-control.pid``); :class:`MpsControl` watches that pid (a pidfd where
the kernel has one: no polling) and starts it again when it dies, with a doubling
back-off, with every cap it had set. Before every start the directories are checked and
cleared of anything a tenant could have planted (:mod:`gpushare.host.mpsdirs`). At stop
it asks the daemon to quit and waits for the pid to go (SIGTERM, then SIGKILL).

What was checked against NVIDIA's documentation, and where (``docs/choosing.md`` keeps
the same list). On a GPU (an H200, driver r580, 2026-11-27, docs/gpu-proof.md) this class
started and stopped the legacy (v2) daemon, multi-user (``-M``), and clients' thread caps
held; v3 (r615+) has not run on a GPU of ours:

* Legacy (v2, the default protocol) commands are lines on the executable's stdin with
  ``CUDA_MPS_PIPE_DIRECTORY`` in its environment (``echo quit | nvidia-cuda-mps-control``):
  ``quit``, ``get_server_list``, ``start_server -uid <uid>``,
  ``set_default_active_thread_percentage <pct>`` (for servers started later),
  ``set_active_thread_percentage <server PID> <pct>``; a client's
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` only lowers what the daemon set.
  https://docs.nvidia.com/deploy/mps/latest/mpsv2-interface.html,
  https://docs.nvidia.com/deploy/topics/topic_5_2_5.html
* v3 is opt-in per daemon: ``-p 3`` at start (or ``CUDA_MPS_PROTOCOL_VERSION=3``); every
  later invocation follows the running daemon's protocol; v3 commands are "module verb"
  arguments (``server create --uid=<uid>``, ``client list --all``, ``-q`` to quit), not
  stdin lines; ``-a <file>`` applies a TOML configuration at start (``schema_version``,
  ``[servers.<name>]`` with ``uid``, ``[servers.<name>.namespaces.<name>]`` with
  ``active_thread_percentage`` and ``pinned_memory_limit`` as strings).
  https://docs.nvidia.com/deploy/mps/latest/mpsv3-interface.html,
  https://docs.nvidia.com/deploy/mps/615/quick-start.html,
  https://docs.nvidia.com/deploy/mps/latest/mpsv3-configuration-file.html
* A v3 namespace belongs to a named server; a client picks it by the socket it connects
  to: ``$CUDA_MPS_PIPE_DIRECTORY/<server>/<namespace>/control``. So a container gets
  ``<pipe>/<server>/<namespace>`` as its ``CUDA_MPS_PIPE_DIRECTORY`` (read-only) and its
  client's ``control`` is its namespace's socket.
  https://docs.nvidia.com/deploy/mps/latest/mpsv3-namespaces.html
* NOT verified (the reference's option list was not readable here): the option
  spellings of the runtime namespace commands in ``mpscommands.V3`` (the verbs ``namespace
  create|set|delete`` are documented, ``--server``/``--name``/``--active-thread-
  percentage``/``--pinned-memory-limit`` follow ``server create --uid=`` and the TOML
  keys), the ``M`` suffix of a pinned limit (the documented examples use ``G``), that a
  v3 client is routed by ``CUDA_MPS_PIPE_DIRECTORY`` pointing at a namespace directory,
  and that the server accepts a namespace directory the daemon made beforehand. A
  restart re-applies every cap through the configuration file (documented keys), not
  through these commands.
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

from gpushare.host import mpsdirs
from gpushare.host.library import cache_key, prepare_cache_dir
from gpushare.host.mpscommands import (
    COMMAND_TIMEOUT,
    MpsCommands,
    NamespaceCaps,
    namespace_pipe,
    v3_config,
)
from gpushare.host.mpscommands import SERVER as SERVER
from gpushare.host.mpscommands import Cap as Cap
from gpushare.host.mpscommands import MpsError as MpsError

log = structlog.get_logger(__name__)

MPS_DIR_NAME = "mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
#: The v3 configuration file written before every start (in the 0700 log directory).
CONFIG_FILE = "mps-v3.toml"
#: Restart back-off: first delay, the most, and how long a run must last to reset it.
BACKOFF_FIRST, BACKOFF_MAX, BACKOFF_RESET = 1.0, 60.0, 120.0
#: Modes of the daemon's directories: the pipe tree is read by every client (through
#: read-only mounts), the log directory by nobody else, shm written by every client.
PIPE_MODE, LOG_MODE, SHM_MODE = 0o755, 0o700, 0o1777


@dataclass(frozen=True)
class Capabilities:
    multi_user: bool  # ``-M``: servers run as root, clients of every uid share them
    namespaces: bool  # v3: per-namespace pipe directories and caps


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
        # r580's help: "-M,--multiuser-server    Enable multi-user mode" (read on an H200,
        # docs/gpu-proof.md)
        multi_user=bool({"-M", "--multiuser-server"} & set(usage.replace(",", " ").split())),
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
        #: one command at a time to the running daemon, and each namespace's cap
        self.commands = MpsCommands(executable, self.pipe_dir, self.log_dir)
        self.namespaces = NamespaceCaps(self.commands, self.pipe_dir)

    # ------------------------------------------------------------------ the process
    def env(self) -> dict[str, str]:
        return self.commands.env()

    def start(self) -> None:
        """Start the control daemon (and the watch that restarts it); MpsError if it
        will not start."""
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

    def namespace_pipe(self, name: str) -> Path:
        """The directory a client of namespace ``name`` uses as its pipe directory."""
        return namespace_pipe(self.pipe_dir, name)

    def _prepare_dirs(self) -> None:
        """Before every start: the directories are real, ours, with their modes, and
        hold nothing a tenant planted (:mod:`gpushare.host.mpsdirs`)."""
        root = self.pipe_dir.parent
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
            mpsdirs.ensure_own_dir(root, PIPE_MODE)
            mpsdirs.ensure_own_dir(self.pipe_dir, PIPE_MODE)
            mpsdirs.ensure_own_dir(self.log_dir, LOG_MODE)
            mpsdirs.ensure_own_dir(root / "shm", SHM_MODE)  # every client writes segments
            mpsdirs.clear_pipe_tree(self.pipe_dir)
            mpsdirs.clear_shm(root / "shm")
            if self.capabilities.namespaces:
                mpsdirs.ensure_own_dir(self.pipe_dir / SERVER, PIPE_MODE)
                for name in self.caps():
                    mpsdirs.ensure_own_dir(self.namespace_pipe(name), PIPE_MODE)
        except OSError as exc:
            raise MpsError(f"cannot prepare the MPS directories under {root}: {exc}") from None

    def _config(self) -> Path:
        """The v3 configuration file (:func:`v3_config`), in the 0700 log directory."""
        path = self.log_dir / CONFIG_FILE
        tmp = self.log_dir / (CONFIG_FILE + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(v3_config(self.caps()))
        os.replace(tmp, path)
        return path

    def _launch(self) -> None:
        self._prepare_dirs()  # also removes the dead daemon's pid file and sockets
        args = [str(self.executable), "-d"]
        if self.capabilities.multi_user:
            args.append("-M")
        if self.capabilities.namespaces:
            try:
                args += ["-p", "3", "-a", str(self._config())]
            except OSError as exc:
                raise MpsError(f"cannot write the MPS configuration: {exc}") from None
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
        pid = self._read_pid(self.pipe_dir / PID_FILE)
        with self._changed:
            self.pid = pid
            self.starts += 1
            self._changed.notify_all()

    def _read_pid(self, pid_file: Path) -> int:
        """The daemon writes its pid file once it serves: wait for it (bounded). Read
        without following a link or opening a FIFO (:func:`mpsdirs.read_pid_file`)."""
        deadline = self._clock() + COMMAND_TIMEOUT
        while True:
            pid = mpsdirs.read_pid_file(pid_file)
            if pid is not None:
                return pid
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
                self._launch()  # v3: the configuration file carries every cap
                log.info("mps_control_restarted", pid=self.pid, caps=len(self.caps()))
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
                if self.capabilities.namespaces:
                    self.command_v3("quit")
                else:
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
        """One legacy control command (:meth:`MpsCommands.command`)."""
        return self.commands.command(line)

    def command_v3(self, verb: str, **fields: object) -> str:
        """One v3 command (:meth:`MpsCommands.command_v3`)."""
        return self.commands.command_v3(verb, **fields)

    def cap(self, name: str, cap: Cap) -> Path:
        """Create (or re-cap) namespace ``name`` (:meth:`NamespaceCaps.cap`); MpsError
        where this control daemon has no namespaces (a driver before r615)."""
        if not self.capabilities.namespaces:
            raise MpsError("this MPS control daemon has no namespaces (driver before r615)")
        return self.namespaces.cap(name, cap)

    def caps(self) -> dict[str, Cap]:
        return self.namespaces.caps()

    def forget(self, name: str) -> None:
        self.namespaces.forget(name)


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

    The memory answer makes the namespace (named after the container's memory units; its
    pipe directory the server's ``<pipe>/<server>/<name>``, which the container mounts
    read-only; a fresh cache directory in the private root marks it alive until the
    garbage collector removes it with the units) and caps it; the core answer caps the
    namespace of its partner (the memory binding of the same container), or, when it
    comes first, leaves its cap for the memory answer that pairs with it. Both run
    before the container is created. Without namespaces nothing is made here: the
    answers carry the client's own caps.
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
        if name in self.control.caps():  # an earlier holder's: a fresh namespace and dir
            self.control.forget(name)
        marker = prepare_cache_dir(self.host_dir, device_ids)
        return self.control.cap(name, Cap(marker, percent, memory_mib if pinned else None))

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
                self.control.cap(name, Cap(known.marker, percent, known.memory_mib))
                return
        with self._lock:
            self._pending[tuple(sorted(device_ids))] = percent
            while len(self._pending) > PENDING_LIMIT:
                self._pending.pop(next(iter(self._pending)))

    def claim(
        self, key: str, marker: Path, memory_mib: int, cores: int, *, pinned: bool
    ) -> Path | None:
        """A DRA claim's share: its namespace (named after its cache key, alive while
        ``marker`` is), capped at ``cores`` (0: not throttled) and, where ``pinned``,
        ``memory_mib``; made at prepare, before any container of the claim exists. Its
        pipe directory (None without namespaces)."""
        if not self.namespaces:
            return None
        percent = min(cores, 100) if cores > 0 else 100
        return self.control.cap(key, Cap(marker, percent, memory_mib if pinned else None))

    def collect(self) -> list[str]:
        """Forget the namespaces whose marker the garbage collector removed (their
        containers are gone); the names forgotten."""
        gone = [name for name, cap in self.control.caps().items() if not cap.marker.is_dir()]
        for name in gone:
            self.control.forget(name)
        return gone
