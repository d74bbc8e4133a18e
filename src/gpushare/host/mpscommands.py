"""Speaking to the running MPS control daemon: one command at a time, and the caps of
each container's namespace set through those commands and kept for a restart.

:class:`MpsCommands` delivers a legacy (v2) command line on the executable's stdin, or
a v3 command as arguments (:data:`V3`), with the daemon's pipe and log directories in
the environment; :class:`NamespaceCaps` creates, caps and removes the namespaces of the
one v3 server (:data:`SERVER`) and keeps every cap, which :class:`~gpushare.host.mps.
MpsControl` writes into the configuration file (:func:`v3_config`) before every start.
What was and was not checked against NVIDIA's documentation is in ``host/mps.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpushare.host import mpsdirs

log = structlog.get_logger(__name__)

#: The one v3 server the namespaces of this node's containers belong to.
SERVER = "gpushare"
#: The v3 runtime commands, as arguments after the executable (see the module's note:
#: the verbs are documented, the option spellings are not verified).
V3: dict[str, tuple[str, ...]] = {
    "create": ("namespace", "create", "--server={server}", "--name={name}"),
    "threads": (
        "namespace",
        "set",
        "--server={server}",
        "--name={name}",
        "--active-thread-percentage={percent}",
    ),
    "memory": (
        "namespace",
        "set",
        "--server={server}",
        "--name={name}",
        "--pinned-memory-limit={mib}M",
    ),
    "remove": ("namespace", "delete", "--server={server}", "--name={name}"),
    "quit": ("-q",),
}
#: How long a command or the daemon's start may take before it counts as failed.
COMMAND_TIMEOUT = 10.0
#: The mode of the pipe tree: read by every client (through read-only mounts).
PIPE_MODE = 0o755


class MpsError(Exception):
    """The control daemon cannot do what was asked; the message is one line."""


@dataclass(frozen=True)
class Cap:
    """One container's namespace: its limits, and the directory whose removal by the
    garbage collector says its container is gone (``marker``: the container's or
    claim's cache directory in the private root, never mounted for MPS)."""

    marker: Path
    percent: int = 100
    memory_mib: int | None = None


def v3_config(caps: Mapping[str, Cap]) -> str:
    """The v3 configuration (TOML, NVIDIA's documented keys): the one server (uid 0:
    root's, shared by clients of every uid in multi-user mode) and each namespace's caps."""
    lines = ['schema_version = "1.0"', "", f"[servers.{SERVER}]", "uid = 0"]
    for name, cap in sorted(caps.items()):
        lines += ["", f"[servers.{SERVER}.namespaces.{name}]"]
        lines.append(f'active_thread_percentage = "{cap.percent}"')
        if cap.memory_mib is not None:
            lines.append(f'pinned_memory_limit = "{cap.memory_mib}M"')
    return "\n".join(lines) + "\n"


def namespace_pipe(pipe_dir: Path, name: str) -> Path:
    """The directory a client of namespace ``name`` uses as its pipe directory:
    ``<pipe>/<server>/<name>``, where the v3 server makes the namespace's socket."""
    if not name or "/" in name or name in (".", ".."):
        raise MpsError(f"{name!r} is not a namespace name")
    return pipe_dir / SERVER / name


class MpsCommands:
    """One command at a time to the control daemon of ``pipe_dir`` and ``log_dir``."""

    def __init__(self, executable: Path, pipe_dir: Path, log_dir: Path) -> None:
        self.executable = executable
        self.pipe_dir, self.log_dir = pipe_dir, log_dir

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def command(self, line: str) -> str:
        """One control command; its answer. MpsError when it cannot be delivered."""
        if "\n" in line:
            raise MpsError("one command per line")
        what = f"MPS control command {line.split()[0]!r}"
        done = self._run([], what, stdin=line + "\n")
        if done.returncode != 0:
            raise _exited(what, done.returncode, done.stderr or done.stdout)
        answer = done.stdout.strip()
        if answer.lower().startswith(_REFUSALS):
            raise MpsError(f"{what}: {answer.splitlines()[0]}")
        return answer

    def command_v3(self, verb: str, **fields: object) -> str:
        """One v3 command of :data:`V3` (arguments after the executable); its answer."""
        args = [word.format(server=SERVER, **fields) for word in V3[verb]]
        what = f"MPS v3 command {' '.join(args[:2])!r}"
        done = self._run(args, what)
        answer = (done.stdout or "").strip()
        if done.returncode != 0 or answer.lower().startswith(_REFUSALS):
            raise _exited(what, done.returncode, answer or done.stderr or "")
        return answer

    def _run(
        self, args: list[str], what: str, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The executable run once with ``args`` (and ``stdin``, None: none given);
        MpsError naming ``what`` when it cannot be started or does not finish in time."""
        try:
            return subprocess.run(
                [str(self.executable), *args],
                input=stdin,
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"{what} failed: {exc}") from None


#: how the control daemon's answer begins when it refuses a command (it may exit 0)
_REFUSALS = ("error", "invalid", "unknown")


def _exited(what: str, code: int, output: str) -> MpsError:
    """A command that failed: its exit status and the first line of ``output``."""
    why = output.strip().splitlines()
    return MpsError(f"{what} exited {code}: {why[0] if why else ''}".strip())


class NamespaceCaps:
    """Each namespace's cap on the v3 server, set through ``commands`` and kept (a
    restart of the control daemon re-applies them through its configuration file)."""

    def __init__(self, commands: MpsCommands, pipe_dir: Path) -> None:
        self.commands = commands
        self.pipe_dir = pipe_dir
        self._caps: dict[str, Cap] = {}  # namespace name -> its cap, re-applied at restart
        self._caps_lock = threading.Lock()

    def cap(self, name: str, cap: Cap) -> Path:
        """Create (or re-cap) namespace ``name`` on the v3 server; its pipe directory
        (made here, real and root's, before the container that mounts it exists). A cap
        that cannot be set is not kept (a restart re-applies the one before)."""
        pipe = namespace_pipe(self.pipe_dir, name)
        with self._caps_lock:
            known = self._caps.get(name)
            self._caps[name] = cap
        try:
            if known is None:
                self.commands.command_v3("create", name=name)
            self.commands.command_v3("threads", name=name, percent=cap.percent)
            if cap.memory_mib is not None:
                self.commands.command_v3("memory", name=name, mib=cap.memory_mib)
            mpsdirs.ensure_own_dir(pipe.parent, PIPE_MODE)
            mpsdirs.ensure_own_dir(pipe, PIPE_MODE)
        except (MpsError, OSError) as exc:  # fail closed, and a restart re-applies the old
            with self._caps_lock:
                if known is None:
                    self._caps.pop(name, None)
                else:
                    self._caps[name] = known
            raise MpsError(f"cannot cap MPS namespace {name}: {exc}") from None
        log.info("mps_namespace_capped", namespace=name, percent=cap.percent, mib=cap.memory_mib)
        return pipe

    def caps(self) -> dict[str, Cap]:
        with self._caps_lock:
            return dict(self._caps)

    def forget(self, name: str) -> None:
        """Remove a namespace whose container is gone, and its directory."""
        with self._caps_lock:
            known = self._caps.pop(name, None)
        if known is not None:
            with contextlib.suppress(MpsError):
                self.commands.command_v3("remove", name=name)
            with contextlib.suppress(OSError, MpsError):
                shutil.rmtree(namespace_pipe(self.pipe_dir, name))  # fd-based: follows no link
